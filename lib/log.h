/*
 * Logging: one printf-style entry point, filtered by level, routed to the application's callback or stderr.
 */
#ifndef CVM_LOG_H
#define CVM_LOG_H

#include "cuvmm.h"

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void cvm_log(enum cuvmm_log_level level, const char *fmt, ...);

/* True when a message of this level would be emitted (to skip building expensive messages). */
int cvm_log_enabled(enum cuvmm_log_level level);

#define cvm_err(...) cvm_log(CUVMM_LOG_ERROR, __VA_ARGS__)
#define cvm_warn(...) cvm_log(CUVMM_LOG_WARN, __VA_ARGS__)
#define cvm_info(...) cvm_log(CUVMM_LOG_INFO, __VA_ARGS__)
#define cvm_debug(...) cvm_log(CUVMM_LOG_DEBUG, __VA_ARGS__)

#endif /* CVM_LOG_H */
