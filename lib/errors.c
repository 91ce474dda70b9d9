/*
 * Error codes: names and messages, all generated from the one list in cuvmm.h.
 */
#include "cuvmm.h"

/* From the header's macros: one place holds the version (meson.build checks that it is the project's). */
#define CVM_STR_(x) #x
#define CVM_XSTR_(x) CVM_STR_(x)
#define CVM_VERSION_STRING                                                                                   \
	CVM_XSTR_(CUVMM_VERSION_MAJOR) "." CVM_XSTR_(CUVMM_VERSION_MINOR) "." CVM_XSTR_(CUVMM_VERSION_PATCH)

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
