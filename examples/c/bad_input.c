/* Bad input through the dmabuf-rt C API: every call below must be refused with the expected
 * status and a reason (dmabuf_rt_last_error, also logged on stderr), write nothing, and leave
 * the allocator working with consistent statistics. Exits non-zero on any unexpected result.
 *
 * Prints one line per kind of bad input (`-v`: every call and its reason).
 *
 * Built and run by examples/c/run:
 *   gcc -std=c11 -Wall -Wextra -Werror bad_input.c $(pkg-config --cflags --libs dmabuf-rt)
 */
#define _POSIX_C_SOURCE 200809L

#include <dmabuf_rt.h>

#include <inttypes.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0, refusals = 0, verbose = 0;

/* The current group of cases: its name, how many were refused, and the first reason. */
static const char *group_name = NULL;
static int group_refusals = 0;
static char group_example[512];

static void group(const char *name) {
    if (group_name && !verbose)
        printf("%-40s %3d refused, e.g. %s\n", group_name, group_refusals, group_example);
    group_name = name;
    group_refusals = 0;
    group_example[0] = 0;
    if (name && verbose) printf("%s:\n", name);
}

/* `call` must return `want` and leave a reason that names the function. */
#define REFUSED(call, want) refused_((call), (want), #call, __LINE__)

static void refused_(dmabuf_rt_status got, dmabuf_rt_status want, const char *call, int line) {
    const char *e = dmabuf_rt_last_error();
    char func[64];
    size_t len = strcspn(call, "(");
    snprintf(func, sizeof func, "%.*s: ", (int)len, call);
    if (got != want || e == NULL || strncmp(e, func, strlen(func)) != 0) {
        printf("FAIL line %d: %s returned %s (expected %s), last error: %s\n", line, call,
               dmabuf_rt_status_name((int)got), dmabuf_rt_status_name((int)want), e ? e : "NULL");
        failures++;
        return;
    }
    refusals++;
    if (group_refusals++ == 0) snprintf(group_example, sizeof group_example, "%s", e);
    if (verbose) printf("  %-26s %s\n", dmabuf_rt_status_name((int)got), e);
}

#define CHECK(call)                                                                             \
    do {                                                                                        \
        dmabuf_rt_status s_ = (call);                                                           \
        if (s_ != DMABUF_RT_OK) {                                                               \
            const char *e_ = dmabuf_rt_last_error();                                            \
            printf("FAIL line %d: %s: %s: %s\n", __LINE__, #call, dmabuf_rt_status_name((int)s_), \
                   e_ ? e_ : "NULL");                                                           \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

#define EXPECT(cond)                                                                            \
    do {                                                                                        \
        if (!(cond)) {                                                                          \
            printf("FAIL line %d: expected %s\n", __LINE__, #cond);                            \
            failures++;                                                                         \
        }                                                                                       \
    } while (0)

static void never_called(dmabuf_rt_stream s, dmabuf_rt_status st, void *user) {
    (void)s, (void)st, (void)user;
    printf("FAIL: a callback given to a dead stream ran\n");
    exit(1);
}

/* The allocator still works on `device`: allocate, fill, read back, free. */
static void still_works(int device) {
    enum { N = 64 * 1024 };
    static unsigned char back[N];
    void *p = NULL;
    CHECK(dmabuf_rt_device_alloc(device, N, &p));
    CHECK(dmabuf_rt_memset(device, p, 0x5a, N));
    memset(back, 0, N);
    CHECK(dmabuf_rt_memcpy(0, back, device, p, N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    for (size_t i = 0; i < N; i++) {
        if (back[i] != 0x5a) {
            printf("FAIL: device %d read back %#x at %zu\n", device, back[i], i);
            exit(1);
        }
    }
    CHECK(dmabuf_rt_device_free(device, p));
}

int main(int argc, char **argv) {
    verbose = argc > 1 && strcmp(argv[1], "-v") == 0;
    /* Before the first call: the runtime reads its environment once. Two devices, so that
     * device 1 exists and 2 does not; a 64 MiB capacity to exceed. */
    setenv("DMABUF_RT_DEVICES", "shmem,shmem", 1);
    setenv("DMABUF_RT_CAPACITY", "64M", 1);
    const size_t capacity = (size_t)64 << 20;

    dmabuf_rt_stats before[2];
    CHECK(dmabuf_rt_device_stats(0, &before[0]));
    CHECK(dmabuf_rt_device_stats(1, &before[1]));

    void *p = (void *)0x1234, *live = NULL, *live1 = NULL;
    uint64_t local[64] = {0};
    unsigned char host[4096] = {0};
    dmabuf_rt_stream stream = 0, dead_stream = 0;
    dmabuf_rt_event event = 0, dead_event = 0;
    bool done = false;
    uint64_t total = 0;
    char name[64];

    group("NULL out-pointers");
    REFUSED(dmabuf_rt_device_count(NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_name(0, NULL, 64), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_get_device(NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_memory(0, &total, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_alloc(0, 4096, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_host_alloc(4096, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_unified_alloc(4096, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_stream_create(0, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_event_create(NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_stats(0, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_snapshot_json(0, NULL), DMABUF_RT_INVALID_POINTER);
    CHECK(dmabuf_rt_stream_create(0, &stream));
    CHECK(dmabuf_rt_event_create(&event));
    REFUSED(dmabuf_rt_stream_query(stream, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_event_query(event, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_stream_add_callback(stream, NULL, NULL), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_stats(0, (dmabuf_rt_stats *)((char *)local + 1)), DMABUF_RT_INVALID_POINTER);
    for (size_t i = 0; i < 64; i++) EXPECT(local[i] == 0);

    group("size 0");
    REFUSED(dmabuf_rt_device_alloc(0, 0, &p), DMABUF_RT_INVALID_ARGUMENT);
    REFUSED(dmabuf_rt_host_alloc(0, &p), DMABUF_RT_INVALID_ARGUMENT);
    REFUSED(dmabuf_rt_unified_alloc(0, &p), DMABUF_RT_INVALID_ARGUMENT);
    EXPECT(p == (void *)0x1234); /* a refused call writes no out-pointer */

    group("foreign, interior and double frees");
    REFUSED(dmabuf_rt_device_free(0, local), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_free(0, NULL), DMABUF_RT_INVALID_POINTER);
    CHECK(dmabuf_rt_device_alloc(0, 10000, &live));
    CHECK(dmabuf_rt_device_alloc(1, 10000, &live1));
    REFUSED(dmabuf_rt_device_free(0, (char *)live + 512), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_device_free(1, live), DMABUF_RT_INVALID_POINTER); /* another device's */
    CHECK(dmabuf_rt_device_free(0, live));
    REFUSED(dmabuf_rt_device_free(0, live), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_host_free(local), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_host_free(live1), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_unified_free(local), DMABUF_RT_INVALID_POINTER);
    void *pinned = NULL, *unified = NULL;
    CHECK(dmabuf_rt_host_alloc(100, &pinned));
    CHECK(dmabuf_rt_unified_alloc(100, &unified));
    CHECK(dmabuf_rt_host_free(pinned));
    REFUSED(dmabuf_rt_host_free(pinned), DMABUF_RT_INVALID_POINTER);
    CHECK(dmabuf_rt_unified_free(unified));
    REFUSED(dmabuf_rt_unified_free(unified), DMABUF_RT_INVALID_POINTER);
    char *json = NULL;
    CHECK(dmabuf_rt_snapshot_json(0, &json));
    REFUSED(dmabuf_rt_string_free((char *)local), DMABUF_RT_INVALID_POINTER);
    CHECK(dmabuf_rt_string_free(json));
    REFUSED(dmabuf_rt_string_free(json), DMABUF_RT_INVALID_POINTER);

    group("devices out of range");
    const int bad_devices[] = {2, 99, -2, INT_MIN, INT_MAX};
    for (size_t i = 0; i < sizeof bad_devices / sizeof *bad_devices; i++) {
        int d = bad_devices[i];
        REFUSED(dmabuf_rt_device_alloc(d, 4096, &p), DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_set_device(d), DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_device_free(d, live1), DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_device_name(d, name, sizeof name), DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_stream_create(d, &dead_stream), DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_memset(d, live1, 0, 16), DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_memcpy(d, live1, 1, live1, 16, DMABUF_RT_MEMCPY_PEER_TO_PEER, 0),
                DMABUF_RT_INVALID_ARGUMENT);
        REFUSED(dmabuf_rt_empty_cache(d), DMABUF_RT_INVALID_ARGUMENT);
    }
    EXPECT(p == (void *)0x1234);

    group("NULL or foreign copy pointers, bad kinds");
    for (int pass = 0; pass < 2; pass++) {
        dmabuf_rt_stream s = pass ? stream : 0; /* synchronous, then on a stream */
        REFUSED(dmabuf_rt_memcpy(1, NULL, 0, host, 16, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s), DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(1, live1, 0, NULL, 16, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, s), DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(0, NULL, 1, live1, 16, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s), DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(0, host, 1, NULL, 16, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s), DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(1, NULL, 1, live1, 16, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, s), DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(0, NULL, 1, live1, 16, DMABUF_RT_MEMCPY_PEER_TO_PEER, s), DMABUF_RT_INVALID_POINTER);
        /* host memory passed as device memory; device 1's memory passed as device 0's */
        REFUSED(dmabuf_rt_memcpy(0, host, 0, host, 16, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, s), DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(0, host, 0, live1, 16, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s), DMABUF_RT_INVALID_POINTER);
        /* a range past the end of the device memory */
        REFUSED(dmabuf_rt_memcpy(0, host, 1, live1, (size_t)32 << 20, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s),
                DMABUF_RT_INVALID_POINTER);
        REFUSED(dmabuf_rt_memcpy(1, live1, 0, host, 16, 7, s), DMABUF_RT_INVALID_ARGUMENT);
    }
    REFUSED(dmabuf_rt_memset(1, NULL, 0, 16), DMABUF_RT_INVALID_POINTER);
    REFUSED(dmabuf_rt_memset(1, host, 0, 16), DMABUF_RT_INVALID_POINTER);
    CHECK(dmabuf_rt_stream_synchronize(stream)); /* refused calls did not fail the stream */

    group("destroyed and unknown handles");
    CHECK(dmabuf_rt_stream_create(0, &dead_stream));
    CHECK(dmabuf_rt_stream_destroy(dead_stream));
    CHECK(dmabuf_rt_event_create(&dead_event));
    CHECK(dmabuf_rt_event_destroy(dead_event));
    const dmabuf_rt_stream bad_streams[] = {dead_stream, 0x12345678, UINT64_MAX};
    for (size_t i = 0; i < 3; i++) {
        dmabuf_rt_stream s = bad_streams[i];
        REFUSED(dmabuf_rt_stream_destroy(s), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_stream_synchronize(s), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_stream_query(s, &done), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_stream_add_callback(s, never_called, NULL), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_stream_wait_event(s, event), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_event_record(event, s), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_memcpy(0, host, 1, live1, 16, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, s), DMABUF_RT_INVALID_HANDLE);
    }
    REFUSED(dmabuf_rt_stream_synchronize(0), DMABUF_RT_INVALID_HANDLE);
    const dmabuf_rt_event bad_events[] = {dead_event, 0, 0x12345678, UINT64_MAX};
    for (size_t i = 0; i < 4; i++) {
        dmabuf_rt_event e = bad_events[i];
        REFUSED(dmabuf_rt_event_destroy(e), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_event_record(e, stream), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_event_query(e, &done), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_event_synchronize(e), DMABUF_RT_INVALID_HANDLE);
        REFUSED(dmabuf_rt_stream_wait_event(stream, e), DMABUF_RT_INVALID_HANDLE);
    }

    group("more than the capacity (64 MiB)");
    REFUSED(dmabuf_rt_device_alloc(0, capacity + 1, &p), DMABUF_RT_OUT_OF_MEMORY);
    REFUSED(dmabuf_rt_device_alloc(1, SIZE_MAX, &p), DMABUF_RT_OUT_OF_MEMORY);
    void *big = NULL;
    CHECK(dmabuf_rt_device_alloc(0, capacity / 2 + (8 << 20), &big));
    REFUSED(dmabuf_rt_device_alloc(0, capacity / 2, &p), DMABUF_RT_OUT_OF_MEMORY);
    CHECK(dmabuf_rt_device_free(0, big));
    EXPECT(p == (void *)0x1234);

    group(NULL);

    /* Afterwards: everything still works and the statistics add up. */
    CHECK(dmabuf_rt_device_alloc(0, capacity / 2, &big)); /* fits again once freed */
    CHECK(dmabuf_rt_device_free(0, big));
    CHECK(dmabuf_rt_device_free(1, live1));
    CHECK(dmabuf_rt_event_record(event, stream));
    CHECK(dmabuf_rt_event_synchronize(event));
    CHECK(dmabuf_rt_event_destroy(event));
    CHECK(dmabuf_rt_stream_destroy(stream));
    still_works(0);
    still_works(1);
    for (int d = 0; d < 2; d++) {
        dmabuf_rt_stats s;
        CHECK(dmabuf_rt_device_stats(d, &s));
        EXPECT(s.allocated_bytes == before[d].allocated_bytes);
        EXPECT(s.allocations == 0);
        EXPECT(s.num_allocs == s.num_frees);
        EXPECT(s.capacity_bytes == capacity);
        if (d == 0) EXPECT(s.num_ooms >= 2);
        CHECK(dmabuf_rt_empty_cache(d));
        CHECK(dmabuf_rt_device_stats(d, &s));
        EXPECT(s.reserved_bytes == 0);
        printf("device %d afterwards: allocated %" PRIu64 ", live %" PRIu64 ", allocs %" PRIu64 " = frees %" PRIu64
               ", ooms %" PRIu64 ", reserved after empty_cache %" PRIu64 "\n",
               d, s.allocated_bytes, s.allocations, s.num_allocs, s.num_frees, s.num_ooms, s.reserved_bytes);
    }
    if (failures) {
        printf("bad_input: %d unexpected results\n", failures);
        return 1;
    }
    printf("bad_input: OK (%d bad calls refused with a reason; the allocator still works)\n", refusals);
    return 0;
}
