/* SyncedMemory (Caffe's, seed 004) through the dmabuf-rt C API: one buffer seen from the host
 * and from a device, kept coherent lazily. Walks through the head's transitions in aliased
 * mode (one buffer, no copies) and in split mode (a pinned host buffer, one copy per
 * transition), lends caller memory with set_host_data / set_device_data and checks that it is
 * never freed, and pushes asynchronously on a stream. Prints each step with the head and the
 * copy count; exits non-zero on any unexpected result.
 *
 * Built and run by examples/c/run:
 *   gcc -std=c11 -Wall -Wextra -Werror synced.c $(pkg-config --cflags --libs dmabuf-rt)
 */
#define _POSIX_C_SOURCE 200809L

#include "check.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


enum { DEV = 0 };
#define N ((size_t)1 << 20)

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 131u + seed + (i >> 10));
}

static int matches(const unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(i * 131u + seed + (i >> 10))) return 0;
    return 1;
}

static int all(const unsigned char *p, size_t n, unsigned char byte) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != byte) return 0;
    return 1;
}

/* Prints a step with the head and the copy count, and checks both. */
static void step(dmabuf_rt_synced s, const char *what, dmabuf_rt_head want_head, uint64_t want_copies) {
    dmabuf_rt_head head = -1;
    uint64_t copies = 0;
    CHECK(dmabuf_rt_synced_head(s, &head));
    CHECK(dmabuf_rt_synced_copies(s, &copies));
    printf("  %-52s head %-28s copies %" PRIu64 "\n", what, dmabuf_rt_head_name(head), copies);
    if (head != want_head || copies != want_copies) {
        fprintf(stderr, "  expected head %s, copies %" PRIu64 "\n", dmabuf_rt_head_name(want_head), want_copies);
        exit(1);
    }
}

static void owns(dmabuf_rt_synced s, bool want_host, bool want_device) {
    bool host = !want_host, device = !want_device;
    CHECK(dmabuf_rt_synced_owns(s, &host, &device));
    printf("  %-52s host %s, device %s\n", "owns", host ? "yes" : "no", device ? "yes" : "no");
    EXPECT(host == want_host && device == want_device);
}

static dmabuf_rt_stats stats(void) {
    dmabuf_rt_stats st;
    CHECK(dmabuf_rt_device_stats(DEV, &st));
    return st;
}

/* The copy count a step leaves: `split` copies in split mode, none when aliased. */
static uint64_t copies_if_split(bool aliased, uint64_t split) { return aliased ? 0 : split; }

/* Seed 004's contract, once aliased and once split. */
static void transitions(bool alias, unsigned char *out) {
    printf("alias = %s:\n", alias ? "true" : "false");
    dmabuf_rt_synced s = 0;
    CHECK(dmabuf_rt_synced_create(DEV, N, alias, &s));
    bool aliased = !alias;
    CHECK(dmabuf_rt_synced_aliased(s, &aliased));
    /* Device memory here is CPU-mappable, so asking for aliasing gets it. */
    EXPECT(aliased == alias);
    size_t size = 0;
    CHECK(dmabuf_rt_synced_size(s, &size));
    EXPECT(size == N);
    step(s, "create", DMABUF_RT_HEAD_UNINITIALIZED, 0);
    owns(s, false, false);

    /* The host writes: the first access allocates and zero-fills. */
    void *h = NULL;
    CHECK(dmabuf_rt_synced_mutable_host_data(s, &h));
    EXPECT(all(h, N, 0));
    fill(h, N, 1);
    step(s, "mutable_host_data, write a pattern", DMABUF_RT_HEAD_AT_HOST, 0);
    /* Aliased, the one buffer is both views; split, the device side is not allocated yet. */
    owns(s, true, aliased);

    /* The device reads: aliased, the same memory; split, one host -> device copy. */
    const void *d = NULL;
    CHECK(dmabuf_rt_synced_device_data(s, &d));
    step(s, "device_data", DMABUF_RT_HEAD_SYNCED, copies_if_split(aliased, 1));
    owns(s, true, true);
    EXPECT((d == h) == aliased);
    memset(out, 0, N);
    CHECK(dmabuf_rt_memcpy(DEV, out, DEV, d, N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    EXPECT(matches(out, N, 1));
    printf("  %-52s the pattern\n", "memcpy device -> host from the device pointer:");

    /* The device writes (a memset stands in for a kernel), then the host reads. */
    void *dm = NULL;
    CHECK(dmabuf_rt_synced_mutable_device_data(s, &dm));
    EXPECT(dm == d);
    CHECK(dmabuf_rt_memset(DEV, dm, 0xa5, N));
    step(s, "mutable_device_data, memset 0xa5", DMABUF_RT_HEAD_AT_DEVICE, copies_if_split(aliased, 1));
    const void *hr = NULL;
    CHECK(dmabuf_rt_synced_host_data(s, &hr));
    step(s, "host_data", DMABUF_RT_HEAD_SYNCED, copies_if_split(aliased, 2));
    EXPECT(hr == h);
    EXPECT(all(hr, N, 0xa5));
    printf("  %-52s 0xa5 everywhere\n", "host_data shows the memset:");

    /* Reading again moves nothing; writing on the host and reading on the device copies. */
    CHECK(dmabuf_rt_synced_device_data(s, &d));
    step(s, "device_data again", DMABUF_RT_HEAD_SYNCED, copies_if_split(aliased, 2));
    CHECK(dmabuf_rt_synced_mutable_host_data(s, &h));
    fill(h, N, 2);
    CHECK(dmabuf_rt_synced_device_data(s, &d));
    step(s, "mutable_host_data, write, device_data", DMABUF_RT_HEAD_SYNCED, copies_if_split(aliased, 3));
    CHECK(dmabuf_rt_memcpy(DEV, out, DEV, d, N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    EXPECT(matches(out, N, 2));
    CHECK(dmabuf_rt_synced_destroy(s));
}

/* Memory lent with set_host_data / set_device_data stays the caller's. */
static void lending(unsigned char *out) {
    const dmabuf_rt_stats base = stats();

    printf("set_host_data, alias = false, plain malloc memory:\n");
    unsigned char *lent = malloc(N);
    EXPECT(lent);
    fill(lent, N, 3);
    dmabuf_rt_synced s = 0;
    CHECK(dmabuf_rt_synced_create(DEV, N, false, &s));
    CHECK(dmabuf_rt_synced_set_host_data(s, lent));
    step(s, "set_host_data(lent)", DMABUF_RT_HEAD_AT_HOST, 0);
    owns(s, false, false);
    const void *d = NULL;
    CHECK(dmabuf_rt_synced_device_data(s, &d));
    step(s, "device_data", DMABUF_RT_HEAD_SYNCED, 1);
    owns(s, false, true);
    CHECK(dmabuf_rt_memcpy(DEV, out, DEV, d, N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    EXPECT(matches(out, N, 3));
    void *dm = NULL;
    CHECK(dmabuf_rt_synced_mutable_device_data(s, &dm));
    CHECK(dmabuf_rt_memset(DEV, dm, 0x3c, N));
    const void *h = NULL;
    CHECK(dmabuf_rt_synced_host_data(s, &h));
    step(s, "mutable_device_data, memset 0x3c, host_data", DMABUF_RT_HEAD_SYNCED, 2);
    /* The transition wrote into the lent memory itself. */
    EXPECT(h == lent && all(lent, N, 0x3c));
    EXPECT(stats().allocations == base.allocations + 1);
    CHECK(dmabuf_rt_synced_destroy(s));
    /* Its own device block went back to the cache; the lent memory is intact and ours. */
    dmabuf_rt_stats st = stats();
    EXPECT(st.allocations == base.allocations && st.allocated_bytes == base.allocated_bytes);
    EXPECT(all(lent, N, 0x3c));
    printf("  %-52s live allocations %" PRIu64 " (as before), lent bytes intact\n", "destroy:", st.allocations);
    free(lent);

    printf("set_device_data, alias = true, memory from dmabuf_rt_device_alloc:\n");
    void *block = NULL;
    CHECK(dmabuf_rt_device_alloc(DEV, N, &block));
    CHECK(dmabuf_rt_memset(DEV, block, 0x77, N));
    CHECK(dmabuf_rt_synced_create(DEV, N, true, &s));
    void *hw = NULL;
    CHECK(dmabuf_rt_synced_mutable_host_data(s, &hw));
    EXPECT(stats().allocations == base.allocations + 2);
    CHECK(dmabuf_rt_synced_set_device_data(s, block));
    step(s, "mutable_host_data, set_device_data(block)", DMABUF_RT_HEAD_AT_DEVICE, 0);
    owns(s, false, false);
    /* Its own block was freed at once; the lent one is now both views. */
    EXPECT(stats().allocations == base.allocations + 1);
    CHECK(dmabuf_rt_synced_host_data(s, &h));
    step(s, "host_data", DMABUF_RT_HEAD_SYNCED, 0);
    EXPECT(h == block && all(h, N, 0x77));
    CHECK(dmabuf_rt_synced_destroy(s));
    st = stats();
    EXPECT(st.allocations == base.allocations + 1);
    printf("  %-52s live allocations %" PRIu64 " (the lent block is still allocated)\n", "destroy:", st.allocations);
    CHECK(dmabuf_rt_memcpy(DEV, out, DEV, block, N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, 0));
    EXPECT(all(out, N, 0x77));
    CHECK(dmabuf_rt_device_free(DEV, block));
    st = stats();
    EXPECT(st.allocations == base.allocations && st.num_allocs - base.num_allocs == st.num_frees - base.num_frees);
    printf("  %-52s live allocations %" PRIu64 ", allocs %" PRIu64 " = frees %" PRIu64 " since the start\n",
           "dmabuf_rt_device_free(block):", st.allocations, st.num_allocs - base.num_allocs,
           st.num_frees - base.num_frees);
}

/* async_device_push: queued on a stream; later work on that stream sees the bytes. */
static void push(bool alias, unsigned char *out) {
    printf("async_device_push, alias = %s:\n", alias ? "true" : "false");
    dmabuf_rt_stream stream = 0;
    CHECK(dmabuf_rt_stream_create(DEV, &stream));
    dmabuf_rt_synced s = 0;
    CHECK(dmabuf_rt_synced_create(DEV, N, alias, &s));

    /* A push needs the newest data on the host: refused from UNINITIALIZED and AT_DEVICE. */
    dmabuf_rt_status st = dmabuf_rt_synced_async_device_push(s, stream);
    EXPECT(st == DMABUF_RT_INVALID_ARGUMENT);
    printf("  %-52s %s\n", "push from UNINITIALIZED:", dmabuf_rt_status_name((int)st));
    void *d = NULL;
    CHECK(dmabuf_rt_synced_mutable_device_data(s, &d));
    st = dmabuf_rt_synced_async_device_push(s, stream);
    EXPECT(st == DMABUF_RT_INVALID_ARGUMENT);
    printf("  %-52s %s\n", "mutable_device_data, push from AT_DEVICE:", dmabuf_rt_status_name((int)st));
    step(s, "(refused: nothing changed)", DMABUF_RT_HEAD_AT_DEVICE, 0);

    void *h = NULL;
    CHECK(dmabuf_rt_synced_mutable_host_data(s, &h));
    fill(h, N, 4);
    step(s, "mutable_host_data, write a pattern", DMABUF_RT_HEAD_AT_HOST, copies_if_split(alias, 1));
    CHECK(dmabuf_rt_synced_async_device_push(s, stream));
    step(s, "async_device_push(stream)", DMABUF_RT_HEAD_SYNCED, copies_if_split(alias, 2));
    /* The device address from before is still the device view; a copy queued after the push
     * on the same stream sees the pushed bytes. */
    memset(out, 0, N);
    CHECK(dmabuf_rt_memcpy(DEV, out, DEV, d, N, DMABUF_RT_MEMCPY_DEVICE_TO_HOST, stream));
    CHECK(dmabuf_rt_stream_synchronize(stream));
    EXPECT(matches(out, N, 4));
    printf("  %-52s the pattern\n", "memcpy device -> host on the stream, synchronize:");
    const void *dr = NULL;
    CHECK(dmabuf_rt_synced_device_data(s, &dr));
    EXPECT(dr == d);
    step(s, "device_data (nothing to move)", DMABUF_RT_HEAD_SYNCED, copies_if_split(alias, 2));
    CHECK(dmabuf_rt_synced_destroy(s));
    CHECK(dmabuf_rt_stream_destroy(stream));
}

int main(void) {
    /* One shmem device unless the caller chose devices. The runtime reads its environment
     * once, at the first call. */
    setenv("DMABUF_RT_DEVICES", "shmem", 0);
    /* Steps on stdout, one line at a time, so they interleave with the library's log of
     * refused calls on stderr in order. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("dmabuf-rt %s, SyncedMemory of %zu KiB on device %d\n", dmabuf_rt_version(), N >> 10, DEV);
    unsigned char *out = malloc(N);
    EXPECT(out);
    const dmabuf_rt_stats base = stats();

    transitions(true, out);
    transitions(false, out);
    lending(out);
    push(true, out);
    push(false, out);

    /* Every SyncedMemory is destroyed: nothing of ours is still allocated. */
    dmabuf_rt_stats st = stats();
    EXPECT(st.allocations == base.allocations && st.allocated_bytes == base.allocated_bytes);
    CHECK(dmabuf_rt_empty_cache(DEV));
    st = stats();
    EXPECT(st.reserved_bytes == 0 && st.num_allocs == st.num_frees);
    printf("all destroyed, cache emptied: device %d allocated %" PRIu64 ", reserved %" PRIu64 ", allocs %" PRIu64
           " = frees %" PRIu64 "\n",
           DEV, st.allocated_bytes, st.reserved_bytes, st.num_allocs, st.num_frees);
    free(out);
    printf("synced: OK\n");
    return 0;
}
