//! The default seccomp profile of `lamina run`: docker's default profile's
//! rules, as the OCI runtime spec's `linux.seccomp` (runc loads it through
//! libseccomp). Pure.
//!
//! Every syscall not named is refused with `EPERM`. Allowed: what ordinary
//! programs use ([`ALLOWED`]); some syscalls only with the capability that
//! makes them safe ([`BY_CAPABILITY`]); and a few only with harmless
//! arguments: `socket` of any family but `AF_VSOCK`, `personality` with the
//! few personas programs ask for, and (without `CAP_SYS_ADMIN`) `clone`
//! without namespace flags and `clone3` answered `ENOSYS`, so that libc falls
//! back to `clone`, whose flags a filter can see. So a container's root
//! cannot reach the kernel keyring (`keyctl`, `add_key`, `request_key`),
//! make a user namespace (`unshare`, `clone(CLONE_NEWUSER)`), load modules,
//! or mount anything. `io_uring_*` are refused too, as moby's profile has
//! since Docker 25 and containerd's since 2.0: io_uring's operations bypass
//! the filter, and it has been a steady source of kernel exploits.

use serde_json::{json, Value};

/// `EPERM`, for syscalls the profile does not name.
const EPERM: u32 = 1;
/// `ENOSYS`, for `clone3` (libc then uses `clone`).
const ENOSYS: u32 = 38;
/// `AF_VSOCK`: no socket of this family (host communication).
const AF_VSOCK: u64 = 40;
/// `CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC |
/// CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET`: none may be set.
const CLONE_NAMESPACES: u64 = 0x7E02_0000;
/// `personality` values allowed: `PER_LINUX`, `PER_LINUX32`, with
/// `UNAME26`, and the query `0xffffffff`.
const PERSONAS: [u64; 5] = [0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// Syscalls allowed to every container, whatever its capabilities.
const ALLOWED: &[&str] = &[
    // files, directories and pipes
    "pipe",
    "pipe2",
    "access",
    "chdir",
    "chmod",
    "chown",
    "chown32",
    "close",
    "close_range",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fadvise64_64",
    "fallocate",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchown",
    "fchown32",
    "fchownat",
    "fcntl",
    "fcntl64",
    "fdatasync",
    "flock",
    "fstat",
    "fstat64",
    "fstatat64",
    "fstatfs",
    "fstatfs64",
    "fsync",
    "ftruncate",
    "ftruncate64",
    "futimesat",
    "getcwd",
    "getdents",
    "getdents64",
    "lchown",
    "lchown32",
    "link",
    "linkat",
    "_llseek",
    "lseek",
    "lstat",
    "lstat64",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "name_to_handle_at",
    "newfstatat",
    "open",
    "openat",
    "openat2",
    "pread64",
    "preadv",
    "preadv2",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "rename",
    "renameat",
    "renameat2",
    "rmdir",
    "sendfile",
    "sendfile64",
    "splice",
    "stat",
    "stat64",
    "statfs",
    "statfs64",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "tee",
    "truncate",
    "truncate64",
    "umask",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimensat_time64",
    "utimes",
    "vmsplice",
    "write",
    "writev",
    // extended attributes
    "fgetxattr",
    "flistxattr",
    "fremovexattr",
    "fsetxattr",
    "getxattr",
    "lgetxattr",
    "listxattr",
    "llistxattr",
    "lremovexattr",
    "lsetxattr",
    "removexattr",
    "setxattr",
    // events, polling, asynchronous I/O
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_ctl_old",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "epoll_wait_old",
    "eventfd",
    "eventfd2",
    "fanotify_mark",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_pgetevents_time64",
    "io_setup",
    "io_submit",
    "ioctl",
    "poll",
    "ppoll",
    "ppoll_time64",
    "pselect6",
    "pselect6_time64",
    "select",
    "_newselect",
    "signalfd",
    "signalfd4",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_gettime64",
    "timerfd_settime",
    "timerfd_settime64",
    // memory
    "brk",
    "madvise",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "mincore",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mmap2",
    "mprotect",
    "mremap",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "remap_file_pages",
    // processes, threads, signals
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "fork",
    "vfork",
    "futex",
    "futex_time64",
    "futex_waitv",
    "get_robust_list",
    "set_robust_list",
    "get_thread_area",
    "set_thread_area",
    "gettid",
    "set_tid_address",
    "kill",
    "tgkill",
    "tkill",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
    "prctl",
    "process_mrelease",
    "restart_syscall",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo",
    "sigaltstack",
    "sigprocmask",
    "sigreturn",
    "wait4",
    "waitid",
    "waitpid",
    "seccomp",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    // identity and limits
    "capget",
    "capset",
    "getegid",
    "getegid32",
    "geteuid",
    "geteuid32",
    "getgid",
    "getgid32",
    "getgroups",
    "getgroups32",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getresgid",
    "getresgid32",
    "getresuid",
    "getresuid32",
    "getrlimit",
    "getrusage",
    "getsid",
    "getuid",
    "getuid32",
    "prlimit64",
    "setfsgid",
    "setfsgid32",
    "setfsuid",
    "setfsuid32",
    "setgid",
    "setgid32",
    "setgroups",
    "setgroups32",
    "setpgid",
    "setpriority",
    "setregid",
    "setregid32",
    "setresgid",
    "setresgid32",
    "setresuid",
    "setresuid32",
    "setreuid",
    "setreuid32",
    "setrlimit",
    "setsid",
    "setuid",
    "setuid32",
    "ugetrlimit",
    "ioprio_get",
    "ioprio_set",
    // scheduling
    "getcpu",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_rr_get_interval_time64",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    // time
    "adjtimex",
    "alarm",
    "clock_adjtime",
    "clock_adjtime64",
    "clock_getres",
    "clock_getres_time64",
    "clock_gettime",
    "clock_gettime64",
    "clock_nanosleep",
    "clock_nanosleep_time64",
    "getitimer",
    "gettimeofday",
    "nanosleep",
    "setitimer",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_gettime64",
    "timer_settime",
    "timer_settime64",
    "times",
    // sockets (and `socket` itself below, by family)
    "accept",
    "accept4",
    "bind",
    "connect",
    "getpeername",
    "getsockname",
    "getsockopt",
    "listen",
    "recv",
    "recvfrom",
    "recvmmsg",
    "recvmmsg_time64",
    "recvmsg",
    "send",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "setsockopt",
    "shutdown",
    "socketcall",
    "socketpair",
    // System V and POSIX IPC
    "ipc",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedreceive_time64",
    "mq_timedsend",
    "mq_timedsend_time64",
    "mq_unlink",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "semtimedop_time64",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    // system information
    "getrandom",
    "sysinfo",
    "uname",
];

/// Syscalls of one architecture family, allowed there.
const BY_ARCH: &[(&str, &[&str])] = &[
    ("x86_64", &["arch_prctl", "modify_ldt"]),
    (
        "aarch64",
        &[
            "arm_fadvise64_64",
            "arm_sync_file_range",
            "sync_file_range2",
            "breakpoint",
            "cacheflush",
            "set_tls",
        ],
    ),
];

/// Syscalls allowed only to a container that holds the capability.
const BY_CAPABILITY: &[(&str, &[&str])] = &[
    ("CAP_DAC_READ_SEARCH", &["open_by_handle_at"]),
    (
        "CAP_SYS_ADMIN",
        &[
            "bpf",
            "clone",
            "clone3",
            "fanotify_init",
            "fsconfig",
            "fsmount",
            "fsopen",
            "fspick",
            "lookup_dcookie",
            "mount",
            "mount_setattr",
            "move_mount",
            "open_tree",
            "perf_event_open",
            "quotactl",
            "quotactl_fd",
            "setdomainname",
            "sethostname",
            "setns",
            "syslog",
            "umount",
            "umount2",
            "unshare",
        ],
    ),
    ("CAP_SYS_BOOT", &["reboot"]),
    ("CAP_SYS_CHROOT", &["chroot"]),
    (
        "CAP_SYS_MODULE",
        &["delete_module", "init_module", "finit_module"],
    ),
    ("CAP_SYS_PACCT", &["acct"]),
    (
        "CAP_SYS_PTRACE",
        &["kcmp", "pidfd_getfd", "process_madvise"],
    ),
    ("CAP_SYS_RAWIO", &["iopl", "ioperm"]),
    (
        "CAP_SYS_TIME",
        &["settimeofday", "stime", "clock_settime", "clock_settime64"],
    ),
    ("CAP_SYS_TTY_CONFIG", &["vhangup"]),
    (
        "CAP_SYS_NICE",
        &[
            "get_mempolicy",
            "mbind",
            "set_mempolicy",
            "set_mempolicy_home_node",
        ],
    ),
    ("CAP_SYSLOG", &["syslog"]),
    ("CAP_BPF", &["bpf"]),
    ("CAP_PERFMON", &["perf_event_open"]),
];

/// The libseccomp architectures of the machine lamina was built for (the
/// native one and those its CPU also runs).
fn architectures() -> &'static [&'static str] {
    match std::env::consts::ARCH {
        "x86_64" => &["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "aarch64" => &["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
        _ => &[],
    }
}

fn allow(names: &[&str]) -> Value {
    json!({"names": names, "action": "SCMP_ACT_ALLOW"})
}

fn allow_if(name: &str, op: &str, value: u64, mask: Option<u64>) -> Value {
    let mut arg = json!({"index": 0, "value": value, "op": op});
    if let Some(mask) = mask {
        // SCMP_CMP_MASKED_EQ: (arg & value) == valueTwo.
        arg = json!({"index": 0, "value": mask, "valueTwo": 0, "op": op});
    }
    json!({"names": [name], "action": "SCMP_ACT_ALLOW", "args": [arg]})
}

/// The profile for a container holding `capabilities` (`CAP_*` names).
pub fn default_profile(capabilities: &[String]) -> Value {
    let holds = |cap: &str| capabilities.iter().any(|c| c == cap);
    let mut rules = vec![allow(ALLOWED)];
    for (arch, names) in BY_ARCH {
        if *arch == std::env::consts::ARCH {
            rules.push(allow(names));
        }
    }
    for (cap, names) in BY_CAPABILITY {
        if holds(cap) {
            rules.push(allow(names));
        }
    }
    rules.push(allow_if("socket", "SCMP_CMP_NE", AF_VSOCK, None));
    for persona in PERSONAS {
        rules.push(allow_if("personality", "SCMP_CMP_EQ", persona, None));
    }
    if !holds("CAP_SYS_ADMIN") {
        let no_namespaces = Some(CLONE_NAMESPACES);
        rules.push(allow_if("clone", "SCMP_CMP_MASKED_EQ", 0, no_namespaces));
        rules.push(json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS}));
    }
    json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "architectures": architectures(),
        "syscalls": rules,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(profile: &Value) -> Vec<String> {
        profile["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["action"] == "SCMP_ACT_ALLOW" && r.get("args").is_none())
            .flat_map(|r| r["names"].as_array().unwrap().iter())
            .map(|n| n.as_str().unwrap().to_string())
            .collect()
    }

    /// What point 8 of the many-tenants issue names: no keyring, no user
    /// namespace, no mounts; clone only without namespace flags.
    #[test]
    fn the_default_profile_refuses_keyrings_namespaces_and_mounts() {
        let caps: Vec<String> = crate::spec::DEFAULT_CAPS
            .iter()
            .map(|c| c.to_string())
            .collect();
        let p = default_profile(&caps);
        assert_eq!(p["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(p["defaultErrnoRet"], EPERM);
        let names = allowed(&p);
        for refused in [
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "keyctl",
            "add_key",
            "request_key",
            "unshare",
            "setns",
            "mount",
            "clone",
            "clone3",
            "init_module",
            "bpf",
        ] {
            assert!(!names.iter().any(|n| n == refused), "{refused} allowed");
        }
        for needed in [
            "read",
            "openat",
            "execve",
            "chroot",
            "futex",
            "rt_sigreturn",
            "pipe",
            "pipe2",
        ] {
            assert!(names.iter().any(|n| n == needed), "{needed} refused");
        }
        let clone = p["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["names"][0] == "clone")
            .expect("a clone rule");
        assert_eq!(clone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        assert_eq!(clone["args"][0]["value"], CLONE_NAMESPACES);
        let mut with_admin = caps.clone();
        with_admin.push("CAP_SYS_ADMIN".into());
        assert!(allowed(&default_profile(&with_admin))
            .iter()
            .any(|n| n == "unshare"));
    }
}
