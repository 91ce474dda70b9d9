/*
 * Test hooks of the host backend: only the tests include this header (drv_host.c defines the hooks). They
 * act on the host backend alone, never on the CUDA backend, and are not exported from libcuvmm.so (hidden,
 * like every internal function: the tests link the internal static library).
 */
#ifndef CVM_DRV_TEST_H
#define CVM_DRV_TEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuvmm.h" /* CUstream */

/* While the gate is closed, events recorded by the host backend stay incomplete, as if a kernel were still
 * running; opening it completes them. Lets tests see that unmaps wait for their fence. */
void cvm_host_gate_close(void);
void cvm_host_gate_open(void);

/* Host backend stream capture, modelled on CUDA's rules so that tests see a capture the library would break:
 * while a capture is under way on a stream, a device synchronisation, a synchronisation of that stream, a
 * copy on it, or a query or wait of an event recorded on it invalidates the capture (and fails). begin
 * returns the capture's id; end returns whether the capture survived (false: it was invalidated). */
uint64_t cvm_host_capture_begin(CUstream stream);
bool cvm_host_capture_end(CUstream stream);

/* Several devices (CUVMM_HOST_DEVICES). The gate of one device: events recorded for it stay incomplete while
 * it is closed, and its device synchronisations wait; the other devices run on. (cvm_host_gate_close/open
 * close and open every device's.) A capture begun with _dev is one on a stream of device `dev`: only a
 * synchronisation of that device invalidates it (cvm_host_capture_begin: of any device). */
void cvm_host_gate_close_dev(int dev);
void cvm_host_gate_open_dev(int dev);
uint64_t cvm_host_capture_begin_dev(CUstream stream, int dev);
/* Threads waiting in the host backend for device `dev`'s gate (event or device synchronisations). */
unsigned cvm_host_gate_waiters(int dev);
/* Peer access refused between two devices (process-wide, every host context): while set, device `dev`
 * cannot access memory of `peer` (can_access_peer says 0 and set_access refuses it). */
void cvm_host_peer_deny(int dev, int peer, bool deny);
/* The devices with access to the host mapping containing `p` (bit i: device i), in any host context;
 * 0 if none or not mapped. */
uint64_t cvm_host_access(const void *p);

/* Run fn(arg) at the start of every host call of one kind (CUVMM_CALL_UNMAP or CUVMM_CALL_RELEASE), on the
 * calling thread, in any host context; fn NULL: none. One hook at a time. */
void cvm_host_call_hook(enum cuvmm_call call, void (*fn)(void *arg), void *arg);

/* Bytes of host memory registered (host_register) and not unregistered, in this process. */
size_t cvm_host_registered_bytes(void);

#endif /* CVM_DRV_TEST_H */
