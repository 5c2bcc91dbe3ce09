/*
 * The calling thread's OpenMP team, as the operating system sees it: each member's kernel thread id and the
 * CPU it is running on. torch's parallel regions and every kernel here run on the same libgomp pool, so
 * member i of a team of a given size is the same kernel thread in each of them (libgomp hands a master's
 * pooled threads out in order); executor/team_placement.py binds those threads to cores by id.
 */
#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Runs one parallel region of `threads` threads; tids[i] / cpus[i] receive member i's kernel thread id and
 * current CPU (-1 where the CPU cannot be read). Returns the team's size (libgomp may give fewer threads than
 * asked); members beyond it are not written. */
KERNEL_API int omp_team_members(int threads, int64_t *tids, int *cpus) {
    int size = 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int id = omp_get_thread_num();
        unsigned cpu = 0;
        tids[id] = (int64_t)syscall(SYS_gettid);
        cpus[id] = syscall(SYS_getcpu, &cpu, NULL, NULL) == 0 ? (int)cpu : -1;
        if (id == 0) size = omp_get_num_threads();
    }
    return size;
}
