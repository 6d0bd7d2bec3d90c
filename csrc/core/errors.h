/*
 * errors.h — the library's error reporting, the leaf every other part builds on: the
 * thread-local message behind nbhd_last_error(), status names, and the helpers that record a
 * message and return a status. Depends on the public header's status codes only.
 */
#ifndef NBHD_CORE_ERRORS_H
#define NBHD_CORE_ERRORS_H

#include "nbhd.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define NBHD_PRINTF(fmt, first) __attribute__((format(printf, fmt, first)))
#else
#define NBHD_PRINTF(fmt, first)
#endif

/* Records the message for nbhd_last_error() and returns status. */
nbhd_status nbhd_fail(nbhd_status status, const char *fmt, ...) NBHD_PRINTF(2, 3);

/* The same, for a broken rule: records "<what> (need <rule>)", where `what` (printf format and
 * arguments) names the field and its value, e.g.
 * nbhd_fail_rule(NBHD_ERR_ARG, "kernel >= 2", "kernel[%d]=%d is invalid", a, K). */
nbhd_status nbhd_fail_rule(nbhd_status status, const char *rule, const char *what, ...) NBHD_PRINTF(3, 4);

#ifdef __cplusplus
}
#endif
#endif /* NBHD_CORE_ERRORS_H */
