/*
 * errors.c — status names and the thread-local last-error message (errors.h). The bottom
 * layer: nothing here knows about problems, tensors or devices.
 */
#include <stdarg.h>
#include <stdio.h>

#include "errors.h"

static _Thread_local char last_error[512];

nbhd_status nbhd_fail(nbhd_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

nbhd_status nbhd_fail_rule(nbhd_status status, const char *rule, const char *what, ...) {
    va_list ap;
    va_start(ap, what);
    const int n = vsnprintf(last_error, sizeof last_error, what, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof last_error)
        snprintf(last_error + n, sizeof last_error - (size_t)n, " (need %s)", rule);
    return status;
}

const char *nbhd_last_error(void) { return last_error; }

const char *nbhd_status_string(nbhd_status status) {
    switch (status) {
    case NBHD_OK: return "NBHD_OK";
    case NBHD_ERR_ARG: return "NBHD_ERR_ARG";
    case NBHD_ERR_UNSUPPORTED: return "NBHD_ERR_UNSUPPORTED";
    case NBHD_ERR_DEVICE: return "NBHD_ERR_DEVICE";
    case NBHD_ERR_WORKSPACE: return "NBHD_ERR_WORKSPACE";
    case NBHD_ERR_ALLOC: return "NBHD_ERR_ALLOC";
    }
    return "NBHD_ERR_UNKNOWN";
}
