/* A tour of the dmabuf-rt C API: devices, device memory, copies of every kind (synchronous,
 * then on a stream with an event and a callback), pinned host memory, statistics, a snapshot,
 * and the cache emptied back to zero. Exits non-zero on any unexpected result.
 *
 * Built and run by examples/c/run:
 *   gcc -std=c11 -Wall -Wextra -Werror tour.c $(pkg-config --cflags --libs dmabuf-rt)
 */
#define _POSIX_C_SOURCE 200809L

#include "check.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31u + seed + (i >> 12));
}

static void print_stats(const char *when, int device) {
    dmabuf_rt_stats s;
    CHECK(dmabuf_rt_device_stats(device, &s));
    printf("  device %d %s: allocated %" PRIu64 " (peak %" PRIu64 "), reserved %" PRIu64 " (peak %" PRIu64
           "), live %" PRIu64 ", allocs %" PRIu64 ", frees %" PRIu64 ", backend allocs %" PRIu64 "\n",
           device, when, s.allocated_bytes, s.peak_allocated_bytes, s.reserved_bytes, s.peak_reserved_bytes,
           s.allocations, s.num_allocs, s.num_frees, s.num_backend_allocs);
}

static void on_done(dmabuf_rt_stream stream, dmabuf_rt_status status, void *user_data) {
    (void)stream;
    atomic_int *called = user_data;
    atomic_store(called, status == DMABUF_RT_OK ? 1 : -1);
}

int main(void) {
    /* Two memory domains (peer copies need two) unless the caller chose devices. The runtime
     * reads its environment once, at the first call. */
    setenv("DMABUF_RT_DEVICES", "shmem,shmem", 0);

    printf("dmabuf-rt %s\n", dmabuf_rt_version());
    int count = 0;
    CHECK(dmabuf_rt_device_count(&count));
    printf("%d devices:\n", count);
    for (int d = 0; d < count; d++) {
        char name[256];
        uint64_t total = 0, free_bytes = 0;
        CHECK(dmabuf_rt_device_name(d, name, sizeof name));
        CHECK(dmabuf_rt_device_memory(d, &total, &free_bytes));
        printf("  device %d: %s, %" PRIu64 " MiB, %" PRIu64 " MiB free\n", d, name, total >> 20, free_bytes >> 20);
    }
    EXPECT(count >= 1);
    const int peer = count >= 2 ? 1 : 0;

    const size_t n = 4u << 20;
    unsigned char *src = malloc(n), *out = malloc(n);
    EXPECT(src && out);
    fill(src, n, 7);

    /* Synchronous copies: host -> device 0 -> device 0 -> peer -> host. */
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK(dmabuf_rt_device_alloc(0, n, &a));
    CHECK(dmabuf_rt_device_alloc(0, n, &b));
    CHECK(dmabuf_rt_device_alloc(peer, n, &c));
    CHECK(dmabuf_rt_memcpy(0, a, 0, src, n, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, 0));
    CHECK(dmabuf_rt_memcpy(0, b, 0, a, n, DMABUF_RT_MEMCPY_DEVICE_TO_DEVICE, 0));
    CHECK(dmabuf_rt_memcpy(peer, c, 0, b, n, DMABUF_RT_MEMCPY_PEER_TO_PEER, 0));
    memset(out, 0, n);
    CHECK(dmabuf_rt_memcpy(0, out, peer, c, n, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    EXPECT(memcmp(out, src, n) == 0);
    printf("synchronous h2d, d2d, p2p, d2h of %zu MiB: bytes match\n", n >> 20);

    /* The same on a stream: the host bytes of an h2d are read before the call returns; the
     * d2h writes `out` when the stream gets there, which the event tells. */
    dmabuf_rt_stream stream = 0;
    dmabuf_rt_event done_event = 0;
    atomic_int called = 0;
    CHECK(dmabuf_rt_stream_create(peer, &stream));
    CHECK(dmabuf_rt_event_create(&done_event));
    CHECK(dmabuf_rt_memset(0, b, 0, n));
    CHECK(dmabuf_rt_memset(peer, c, 0, n));
    fill(src, n, 99);
    CHECK(dmabuf_rt_memcpy(0, b, 0, src, n, DMABUF_RT_MEMCPY_HOST_TO_DEVICE, stream));
    memset(src, 0, n / 2); /* allowed: the copy already has the bytes */
    fill(src, n / 2, 99);
    CHECK(dmabuf_rt_memcpy(peer, c, 0, b, n, DMABUF_RT_MEMCPY_PEER_TO_PEER, stream));
    memset(out, 0, n);
    /* A pointer into the middle of a block is fine for copies. */
    CHECK(dmabuf_rt_memcpy(0, out + 4096, peer, (unsigned char *)c + 4096, n - 4096,
                           DMABUF_RT_MEMCPY_DEVICE_TO_HOST, stream));
    CHECK(dmabuf_rt_event_record(done_event, stream));
    CHECK(dmabuf_rt_stream_add_callback(stream, on_done, &called));
    CHECK(dmabuf_rt_event_synchronize(done_event));
    bool done = false;
    CHECK(dmabuf_rt_event_query(done_event, &done));
    EXPECT(done);
    EXPECT(memcmp(out + 4096, src + 4096, n - 4096) == 0);
    CHECK(dmabuf_rt_stream_synchronize(stream));
    CHECK(dmabuf_rt_stream_query(stream, &done));
    EXPECT(done);
    EXPECT(atomic_load(&called) == 1);
    printf("stream h2d, p2p, d2h with an event and a callback: bytes match, callback ran\n");

    /* Pinned host memory as the host side. */
    void *pinned = NULL;
    CHECK(dmabuf_rt_host_alloc(n, &pinned));
    CHECK(dmabuf_rt_memcpy(0, pinned, 0, b, n, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    EXPECT(memcmp(pinned, src, n) == 0);
    printf("d2h into pinned host memory: bytes match\n");

    print_stats("in use", 0);
    print_stats("in use", peer);
    dmabuf_rt_stats s0;
    CHECK(dmabuf_rt_device_stats(0, &s0));
    EXPECT(s0.allocations == (peer == 0 ? 3u : 2u));
    EXPECT(s0.allocated_bytes >= 2 * n && s0.reserved_bytes >= s0.allocated_bytes);

    char *json = NULL;
    CHECK(dmabuf_rt_snapshot_json(0, &json));
    EXPECT(strstr(json, "\"segments\":[") != NULL);
    printf("snapshot of device 0: %zu bytes of JSON: %.96s...\n", strlen(json), json);
    CHECK(dmabuf_rt_string_free(json));

    CHECK(dmabuf_rt_device_free(0, a));
    CHECK(dmabuf_rt_device_free(0, b));
    CHECK(dmabuf_rt_device_free(peer, c));
    CHECK(dmabuf_rt_host_free(pinned));
    CHECK(dmabuf_rt_event_destroy(done_event));
    CHECK(dmabuf_rt_stream_destroy(stream));
    print_stats("after free", 0);
    for (int d = 0; d < count; d++) {
        CHECK(dmabuf_rt_empty_cache(d));
        dmabuf_rt_stats s;
        CHECK(dmabuf_rt_device_stats(d, &s));
        EXPECT(s.allocated_bytes == 0 && s.reserved_bytes == 0 && s.allocations == 0);
        EXPECT(s.num_allocs == s.num_frees);
    }
    print_stats("after empty_cache", 0);
    free(src);
    free(out);
    printf("tour: OK\n");
    return 0;
}
