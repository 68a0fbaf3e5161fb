/* What the dmabuf-rt C examples share: a failed call or expectation ends the program with the
 * call, the status and the library's reason on stderr. */
#ifndef DMABUF_RT_EXAMPLE_CHECK_H
#define DMABUF_RT_EXAMPLE_CHECK_H

#include <dmabuf_rt.h>

#include <stdio.h>
#include <stdlib.h>

static const char *why(void) {
    const char *e = dmabuf_rt_last_error();
    return e ? e : "(no reason recorded)";
}

/* Every call must succeed. */
#define CHECK(call)                                                                             \
    do {                                                                                        \
        dmabuf_rt_status s_ = (call);                                                           \
        if (s_ != DMABUF_RT_OK) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,                 \
                    dmabuf_rt_status_name((int)s_), why());                                     \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

#define EXPECT(cond)                                                                            \
    do {                                                                                        \
        if (!(cond)) {                                                                          \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);                 \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

#endif
