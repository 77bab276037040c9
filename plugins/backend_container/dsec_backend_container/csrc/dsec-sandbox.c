/*
 * dsec-sandbox: the container backend's native helper. No Python stays behind per sandbox:
 * the only process an idle sandbox has is `init` below (a few hundred KiB).
 *
 *   dsec-sandbox init --rootfs DIR --lower A:B --upper DIR --work DIR --hostname NAME
 *                     [--netns FILE] [--cgroup FILE]... [--ready-fd N]
 *     Joins the cgroups (FILE is a cgroup.procs), enters new mount, PID, UTS, IPC and (unless
 *     --netns) network namespaces, mounts the overlay root with /proc, a minimal /dev and
 *     /sys, pivots into it and becomes PID 1: it reaps orphans and nothing else. Once ready,
 *     its host PID is written to --ready-fd (default 1) and this process exits 0; on failure
 *     the reason goes to stderr and it exits 1, leaving no process behind.
 *
 *   dsec-sandbox exec --pid PID [--cgroup FILE]... [--uid N] [--gid N] [--cwd DIR]
 *                     [--seccomp FILE] [--fsize BYTES] [--status-fd N] -- ARGV...
 *     Joins the cgroups and every namespace of PID (a sandbox's init), forks the command as
 *     a session leader, drops capabilities to a container set, sets no_new_privs, loads the
 *     seccomp program, and runs ARGV with this process's environment. On --status-fd it
 *     writes "pid <host pid>\n" when the command starts (its process group, for the caller to
 *     kill) and "status <wait status>\n" when it ends. Forwards SIGTERM/SIGINT/SIGHUP to the
 *     process group. Exits 0 once the command has ended, 1 if it could not start it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

#define MAX_CGROUPS 16

static char *args_start, *args_end; /* our command line, rewritten by init to hide host paths */

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("dsec-sandbox: ", stderr);
    vfprintf(stderr, fmt, ap);
    if (errno) fprintf(stderr, ": %s", strerror(errno));
    fputc('\n', stderr);
    va_end(ap);
    _exit(1);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die("open %s", path);
    if (write(fd, text, strlen(text)) < 0) die("write %s", path);
    close(fd);
}

static void join_cgroups(char **files, int n) {
    char pid[32];
    snprintf(pid, sizeof pid, "%d", getpid());
    for (int i = 0; i < n; i++) write_file(files[i], pid);
}

/* ---------------------------------------------------------------------------------------- */
/* init                                                                                      */

static void must_mount(const char *src, const char *dst, const char *type, unsigned long fl,
                       const char *data) {
    if (mount(src, dst, type, fl, data) < 0) die("mount %s on %s", type ? type : src, dst);
}

static void make_dev(void) {
    static const struct { const char *name; int major, minor; } nodes[] = {
        {"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9},
        {"tty", 5, 0},
    };
    mkdir("dev", 0755);
    must_mount("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k");
    char path[64];
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        snprintf(path, sizeof path, "dev/%s", nodes[i].name);
        if (mknod(path, S_IFCHR | 0666, makedev(nodes[i].major, nodes[i].minor)) < 0)
            die("mknod %s", path);
        chmod(path, 0666);
    }
    mkdir("dev/pts", 0755);
    must_mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
               "newinstance,ptmxmode=0666,mode=0620");
    mkdir("dev/shm", 01777);
    must_mount("tmpfs", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m");
    symlink("pts/ptmx", "dev/ptmx");
    symlink("/proc/self/fd", "dev/fd");
    symlink("/proc/self/fd/0", "dev/stdin");
    symlink("/proc/self/fd/1", "dev/stdout");
    symlink("/proc/self/fd/2", "dev/stderr");
}

/* Host-wide knobs under /proc (sysctls, sysrq, ...) only check uid 0: make them read-only,
 * and hide what tells about the host (Docker's lists). */
static void protect_proc(void) {
    static const char *readonly[] = {"proc/sys", "proc/sysrq-trigger", "proc/irq", "proc/bus",
                                     "proc/fs"};
    static const char *hidden[] = {"proc/kcore", "proc/keys", "proc/timer_list",
                                   "proc/sched_debug", "proc/latency_stats", "proc/acpi",
                                   "proc/scsi", "proc/asound"};
    struct stat st;
    for (size_t i = 0; i < sizeof readonly / sizeof readonly[0]; i++) {
        if (stat(readonly[i], &st) < 0) continue;
        must_mount(readonly[i], readonly[i], NULL, MS_BIND | MS_REC, NULL);
        must_mount(NULL, readonly[i], NULL,
                   MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    }
    for (size_t i = 0; i < sizeof hidden / sizeof hidden[0]; i++) {
        if (stat(hidden[i], &st) < 0) continue;
        if (S_ISDIR(st.st_mode))
            must_mount("tmpfs", hidden[i], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=0");
        else
            must_mount("dev/null", hidden[i], NULL, MS_BIND, NULL);
    }
}

static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP;
        ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    close(s);
}

static void setup_root(const char *rootfs, const char *lower, const char *upper,
                       const char *work, const char *hostname) {
    char opts[8192];
    if (snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work) >=
        (int)sizeof opts)
        die("overlay options too long");
    must_mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    must_mount("overlay", rootfs, "overlay", MS_NODEV, opts);
    if (chdir(rootfs) < 0) die("chdir %s", rootfs);
    mkdir("proc", 0555);
    must_mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mkdir("sys", 0555);
    must_mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    make_dev();
    protect_proc();
    mkdir("tmp", 01777);
    chmod("tmp", 01777); /* the umask applies to mkdir */
    if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root");
    if (umount2(".", MNT_DETACH) < 0) die("umount the old root");
    if (chdir("/") < 0) die("chdir /");
    if (sethostname(hostname, strlen(hostname)) < 0) die("sethostname");
    loopback_up();
}

static int init_loop(void) {
    sigset_t set;
    sigfillset(&set);
    sigprocmask(SIG_BLOCK, &set, NULL);
    int fd = open("/dev/null", O_RDWR);
    for (int i = 0; i < 3; i++) dup2(fd, i);
    if (fd > 2) close(fd);
    for (;;) {
        siginfo_t info;
        if (sigwaitinfo(&set, &info) < 0) continue;
        if (info.si_signo == SIGCHLD) {
            while (waitpid(-1, NULL, WNOHANG) > 0) {}
        } else if (info.si_signo == SIGTERM) {
            kill(-1, SIGKILL);
            return 0;
        }
    }
}

static int cmd_init(int argc, char **argv) {
    const char *rootfs = NULL, *lower = NULL, *upper = NULL, *work = NULL, *host = "sandbox";
    const char *netns = NULL;
    char *cgroups[MAX_CGROUPS];
    int ncg = 0, ready_fd = 1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("%s needs a value", a);
        if (!strcmp(a, "--rootfs")) rootfs = v;
        else if (!strcmp(a, "--lower")) lower = v;
        else if (!strcmp(a, "--upper")) upper = v;
        else if (!strcmp(a, "--work")) work = v;
        else if (!strcmp(a, "--hostname")) host = v;
        else if (!strcmp(a, "--netns")) netns = v;
        else if (!strcmp(a, "--ready-fd")) ready_fd = atoi(v);
        else if (!strcmp(a, "--cgroup") && ncg < MAX_CGROUPS) cgroups[ncg++] = (char *)v;
        else die("unknown option %s", a);
        i++;
    }
    errno = 0;
    if (!rootfs || !lower || !upper || !work) die("init needs --rootfs --lower --upper --work");
    join_cgroups(cgroups, ncg);
    if (netns) {
        int fd = open(netns, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) die("enter network namespace %s", netns);
        close(fd);
    }
    int flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC;
    if (!netns) flags |= CLONE_NEWNET;
    if (unshare(flags) < 0) die("unshare");
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0) die("pipe");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(sync[0]);
        if (ready_fd > 2) close(ready_fd);
        setup_root(rootfs, lower, upper, work, host);
        memset(args_start, 0, args_end - args_start);
        strcpy(args_start, "init");
        if (write(sync[1], "1", 1) != 1) _exit(1);
        close(sync[1]);
        _exit(init_loop());
    }
    close(sync[1]);
    char ok;
    if (read(sync[0], &ok, 1) != 1) {
        int status;
        waitpid(pid, &status, 0);
        errno = 0;
        die("the sandbox did not start (see above)");
    }
    char out[32];
    int n = snprintf(out, sizeof out, "%d\n", pid);
    if (write(ready_fd, out, n) != n) {
        kill(pid, SIGKILL);
        die("report the init pid");
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* exec                                                                                      */

static pid_t child = -1;

static void forward(int sig) {
    if (child > 0) kill(-child, sig);
}

/* capabilities a container keeps: Docker's default set without CAP_MKNOD (no devices
 * cgroup here, so a device node made in the sandbox would reach the host's disks) */
static const int keep_caps[] = {
    CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FSETID, CAP_FOWNER, CAP_NET_RAW, CAP_SETGID,
    CAP_SETUID, CAP_SETFCAP, CAP_SETPCAP, CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT, CAP_KILL,
    CAP_AUDIT_WRITE,
};

static void drop_capabilities(void) {
    unsigned long long keep = 0;
    for (size_t i = 0; i < sizeof keep_caps / sizeof keep_caps[0]; i++) keep |= 1ULL << keep_caps[i];
    for (int c = 0; c <= CAP_LAST_CAP; c++)
        if (!(keep & (1ULL << c)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            die("drop capability %d", c);
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) < 0) die("capget");
    for (int i = 0; i < 2; i++) {
        unsigned int k = (unsigned int)(keep >> (32 * i));
        data[i].effective &= k;
        data[i].permitted &= k;
        data[i].inheritable = 0;
    }
    if (syscall(SYS_capset, &hdr, data) < 0) die("capset");
}

static struct sock_filter prog[4096];

/* read before entering the sandbox: the file is on the host */
static unsigned short read_seccomp(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("open %s", path);
    ssize_t n = read(fd, prog, sizeof prog);
    close(fd);
    if (n <= 0 || n % sizeof prog[0]) die("bad seccomp program %s", path);
    return (unsigned short)(n / sizeof prog[0]);
}

static void load_seccomp(unsigned short len) {
    struct sock_fprog fprog = {len, prog};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) < 0) die("load seccomp");
}

static int cmd_exec(int argc, char **argv) {
    const char *cwd = "/", *seccomp = NULL;
    char *cgroups[MAX_CGROUPS];
    int ncg = 0, pid_fd = -1;
    long uid = -1, gid = -1, fsize = -1;
    pid_t target = 0;
    int i = 0;
    for (; i < argc && strcmp(argv[i], "--"); i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("%s needs a value", a);
        if (!strcmp(a, "--pid")) target = atoi(v);
        else if (!strcmp(a, "--uid")) uid = atol(v);
        else if (!strcmp(a, "--gid")) gid = atol(v);
        else if (!strcmp(a, "--cwd")) cwd = v;
        else if (!strcmp(a, "--seccomp")) seccomp = v;
        else if (!strcmp(a, "--status-fd")) pid_fd = atoi(v);
        else if (!strcmp(a, "--fsize")) fsize = atol(v);
        else if (!strcmp(a, "--cgroup") && ncg < MAX_CGROUPS) cgroups[ncg++] = (char *)v;
        else die("unknown option %s", a);
        i++;
    }
    errno = 0;
    if (i >= argc - 1 || target <= 0) die("exec needs --pid PID -- ARGV");
    char **cmd = argv + i + 1;
    unsigned short filter_len = seccomp ? read_seccomp(seccomp) : 0;
    join_cgroups(cgroups, ncg);
    static const struct { const char *name; int type; } ns[] = {
        {"ipc", CLONE_NEWIPC}, {"uts", CLONE_NEWUTS}, {"net", CLONE_NEWNET},
        {"pid", CLONE_NEWPID}, {"mnt", CLONE_NEWNS},
    };
    int fds[5];
    char path[64];
    for (int k = 0; k < 5; k++) {
        snprintf(path, sizeof path, "/proc/%d/ns/%s", target, ns[k].name);
        if ((fds[k] = open(path, O_RDONLY | O_CLOEXEC)) < 0) die("open %s", path);
    }
    for (int k = 0; k < 5; k++) {
        if (setns(fds[k], ns[k].type) < 0) die("enter the sandbox's %s namespace", ns[k].name);
        close(fds[k]);
    }
    child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        setsid();
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (pid_fd > 2) close(pid_fd);
        drop_capabilities(); /* first, as root: changing uid leaves no right to do it */
        if (gid >= 0 && (setgroups(0, NULL) < 0 || setresgid(gid, gid, gid) < 0)) die("setgid");
        if (uid >= 0 && setresuid(uid, uid, uid) < 0) die("setuid");
        if (chdir(cwd) < 0) {
            fprintf(stderr, "dsec: cannot enter %s: %s\n", cwd, strerror(errno));
            _exit(126);
        }
        if (fsize >= 0) {
            struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
            if (setrlimit(RLIMIT_FSIZE, &rl) < 0) die("limit file size");
        }
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs");
        if (filter_len) load_seccomp(filter_len);
        execvp(cmd[0], cmd);
        fprintf(stderr, "dsec: cannot run %s: %s\n", cmd[0], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    char out[48];
    if (pid_fd >= 0) {
        int n = snprintf(out, sizeof out, "pid %d\n", child);
        if (write(pid_fd, out, n) != n) { /* the caller stopped listening: carry on */ }
    }
    struct sigaction sa = {0};
    sa.sa_handler = forward;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) die("wait");
    if (pid_fd >= 0) {
        int n = snprintf(out, sizeof out, "status %d\n", status);
        if (write(pid_fd, out, n) != n) { /* gone */ }
    }
    return 0;
}

int main(int argc, char **argv) {
    args_start = argv[0];
    args_end = argv[argc - 1] + strlen(argv[argc - 1]) + 1;
    if (argc >= 2 && !strcmp(argv[1], "init")) return cmd_init(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "exec")) return cmd_exec(argc - 2, argv + 2);
    fprintf(stderr, "usage: dsec-sandbox init|exec ... (see the source's header)\n");
    return 2;
}
