/*
 * Error codes: names and messages, all generated from the one list in cuvmm.h.
 */
#include "cuvmm.h"

#define CVM_VERSION_STRING "0.1.0"

const char *cuvmm_strerror(int err)
{
	switch (err) {
#define CVM_ERR_MSG_(name, value, msg)                                                                       \
	case value:                                                                                          \
		return msg;
		CUVMM_ERRNO_MAP(CVM_ERR_MSG_)
#undef CVM_ERR_MSG_
	}
	return "unknown error";
}

const char *cuvmm_err_name(int err)
{
	switch (err) {
#define CVM_ERR_NAME_(name, value, msg)                                                                      \
	case value:                                                                                          \
		return "CUVMM_" #name;
		CUVMM_ERRNO_MAP(CVM_ERR_NAME_)
#undef CVM_ERR_NAME_
	}
	return "CUVMM_E?";
}

const char *cuvmm_version(void)
{
	return CVM_VERSION_STRING;
}
