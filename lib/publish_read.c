/*
 * Reading a published page (publish.h): the one reader, built into the library (for its tests) and into
 * cuvmm-top. Needs nothing else of the library.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "publish.h"

int cvm_pub_read(const char *path, struct cvm_pub_page *out)
{
	const struct cvm_pub_page *p;
	struct stat st;
	int fd, ret = CVM_PUB_READ_EMPTY;

	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return CVM_PUB_READ_IO;
	if (fstat(fd, &st)) {
		close(fd);
		return CVM_PUB_READ_IO;
	}
	if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < sizeof(*p)) {
		close(fd);
		return CVM_PUB_READ_FORMAT;
	}
	p = mmap(NULL, sizeof(*p), PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED)
		return CVM_PUB_READ_IO;
	if (memcmp(p->magic, CVM_PUB_MAGIC, 8) || p->version != CVM_PUB_VERSION || p->size != sizeof(*p)) {
		munmap((void *)p, sizeof(*p));
		return CVM_PUB_READ_FORMAT;
	}
	/* The seqlock: a copy between two equal even values of seq is whole. A writer holds it odd for a
	 * few microseconds; 1000 tries outlast any snapshot, so a writer killed mid-write reads as EMPTY. */
	for (int tries = 0; tries < 1000; tries++) {
		uint64_t s1 = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE), s2;

		if (s1 == 0)
			break;
		if (s1 & 1) {
			sched_yield();
			continue;
		}
		memcpy(out, p, sizeof(*out));
		__atomic_thread_fence(__ATOMIC_ACQUIRE);
		s2 = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
		if (s1 == s2) {
			out->seq = s1;
			ret = CVM_PUB_READ_OK;
			break;
		}
	}
	munmap((void *)p, sizeof(*p));
	if (ret == CVM_PUB_READ_OK && (out->ndev > CVM_PUB_MAX_DEVICES || out->nobj > CVM_PUB_MAX_OBJECTS))
		ret = CVM_PUB_READ_FORMAT;
	if (ret == CVM_PUB_READ_OK) {
		out->comm[sizeof(out->comm) - 1] = '\0';
		for (uint32_t i = 0; i < out->nobj; i++) {
			out->obj[i].kind[sizeof(out->obj[i].kind) - 1] = '\0';
			out->obj[i].name[sizeof(out->obj[i].name) - 1] = '\0';
		}
	}
	return ret;
}

/* Fields 3 (state) and 22 (start time, clock ticks since boot) of /proc/<pid>/stat; false if unreadable. */
static bool proc_stat(int64_t pid, char *state, uint64_t *start)
{
	char path[64], buf[1024], *s;
	unsigned long long v = 0;
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%lld/stat", (long long)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return false;
	buf[n] = '\0';
	/* The name (field 2) may hold blanks and parentheses: count fields after its last ')'. */
	s = strrchr(buf, ')');
	if (!s || s[1] != ' ' || !s[2])
		return false;
	*state = s[2];
	s++;
	for (int field = 2; field < 21 && s; field++)
		s = strchr(s + 1, ' ');
	if (!s || sscanf(s, " %llu", &v) != 1)
		return false;
	*start = v;
	return true;
}

uint64_t cvm_pub_start_time(int64_t pid)
{
	char state;
	uint64_t start;

	return proc_stat(pid, &state, &start) ? start : 0;
}

bool cvm_pub_dead(const struct cvm_pub_page *p)
{
	char state;
	uint64_t start;

	if (p->pid <= 0 || (kill((pid_t)p->pid, 0) && errno == ESRCH))
		return true;
	if (!proc_stat(p->pid, &state, &start))
		return false; /* no /proc: alive, as kill() says */
	/* A zombie has ended; a different start time is a later process that got the pid. */
	return state == 'Z' || state == 'X' || (p->start_time && start != p->start_time);
}
