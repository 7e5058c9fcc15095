/*
 * A CPU-hot function with a name nothing else has, for the flame graph
 * test of `tokentrace record` (tests/session_record.rs). The test server
 * (tests/servers/hot_sse.py) calls it through ctypes before every token,
 * so the on-CPU profile of the server must show it.
 *
 * Native code on purpose: the profiler symbolises native stacks (ELF
 * symbols), so a hot Python function would only show up as interpreter
 * frames; a distinctive exported C symbol is unambiguous.
 *
 * Build: cc -O1 -g -fno-omit-frame-pointer -shared -fPIC -o libtt_hot.so hot_spin.c
 */
#include <stdint.h>
#include <time.h>

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Spins on the CPU for `ns` nanoseconds; returns the iterations done. */
__attribute__((noinline, visibility("default")))
uint64_t tokentrace_test_hot_spin(uint64_t ns)
{
	uint64_t until = now_ns() + ns;
	volatile uint64_t x = 0;
	uint64_t iterations = 0;

	while (now_ns() < until) {
		for (int i = 0; i < 1000; i++)
			x += (uint64_t)i * 2654435761u;
		iterations++;
	}
	return iterations + (x & 1);
}
