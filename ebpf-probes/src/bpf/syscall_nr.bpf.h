/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * What the raw syscall hooks (tp_btf/sys_enter, tp_btf/sys_exit) need to
 * know per architecture: the numbers of the syscalls sock.bpf.c watches,
 * where their arguments are in the user registers, and whether the call is
 * a 32-bit compat one (other numbers: not ours). The per-syscall
 * tracepoints hid all of this; only x86-64 is built (include/x86_64).
 */
#ifndef TOKENTRACE_SYSCALL_NR_BPF_H
#define TOKENTRACE_SYSCALL_NR_BPF_H

#if defined(__TARGET_ARCH_x86)

/* arch/x86/entry/syscalls/syscall_64.tbl */
#define TT_NR_READ 0
#define TT_NR_WRITE 1
#define TT_NR_CLOSE 3
#define TT_NR_MMAP 9
#define TT_NR_READV 19
#define TT_NR_WRITEV 20
#define TT_NR_SENDFILE 40
#define TT_NR_ACCEPT 43
#define TT_NR_SENDTO 44
#define TT_NR_RECVFROM 45
#define TT_NR_SENDMSG 46
#define TT_NR_RECVMSG 47
#define TT_NR_LISTEN 50
#define TT_NR_ACCEPT4 288

/* The syscall ABI's argument registers (the 4th is r10, not rcx). Direct
 * loads: the hooks' regs argument is a BTF pointer. */
#define SYSCALL_ARG(regs, n)                                              \
	((n) == 0 ? (regs)->di :                                          \
	 (n) == 1 ? (regs)->si :                                          \
	 (n) == 2 ? (regs)->dx :                                          \
	 (n) == 3 ? (regs)->r10 :                                         \
	 (n) == 4 ? (regs)->r8 : (regs)->r9)
#define SYSCALL_NR(regs) ((long)(regs)->orig_ax)

/* TS_COMPAT (arch/x86/include/asm/thread_info.h): an int 0x80 / 32-bit
 * syscall, numbered from syscall_32.tbl. */
#define TT_TS_COMPAT 0x0002

static __always_inline bool compat_syscall(void)
{
	struct task_struct *task = bpf_get_current_task_btf();

	return task->thread_info.status & TT_TS_COMPAT;
}

#else
#error "syscall_nr.bpf.h: only x86-64 syscall numbers are written down"
#endif

#endif /* TOKENTRACE_SYSCALL_NR_BPF_H */
