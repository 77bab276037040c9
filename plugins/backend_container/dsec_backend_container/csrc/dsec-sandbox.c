/*
 * dsec-sandbox: the container backend's native helper. No Python stays behind per sandbox:
 * the only process an idle sandbox has is `init` below (a few hundred KiB).
 *
 * Every command is started by the edge, as host root, with an empty environment and no
 * inherited descriptor but those named on its command line. The order of privilege steps is
 * written once, here: namespaces first, then the sandbox's user namespace, then the uid,
 * capabilities, no_new_privs and seccomp, then exec. Every process this helper puts into a
 * sandbox is non-dumpable from its start until it execs the sandbox's program (or for ever,
 * for init and file operations), so nothing in the sandbox can ptrace it, read its memory or
 * take its descriptors in the window before its seccomp filter is in place.
 *
 *   dsec-sandbox init --dir DIR --lower A:B:... --uid-base N --uid-count N --hostname NAME
 *                     [--netns FILE] [--cgroup FILE]... --ready-fd N
 *     DIR holds rw/ (upper/ and work/ of the overlay, files owned by uids as the sandbox sees
 *     them), m/ (mount points m/0.. for the lowers and m/rw) and rootfs/. Makes the
 *     sandbox's user namespace (its uid and gid 0..N-1 are the host's BASE..BASE+N-1),
 *     joins the cgroups (FILE is a cgroup.procs), enters new mount, PID, UTS, IPC, cgroup
 *     (its cgroups are its /) and (unless --netns) network namespaces, owned by the host's
 *     user namespace, so that root
 *     in the sandbox has no power over them. Mounts the lowers and rw/ idmapped into the
 *     sandbox's user namespace (files owned by 0 on disk are its root's), the overlay root
 *     with /proc, a minimal /dev and /sys, pivots into it and becomes PID 1, in the
 *     sandbox's user namespace as its root, with no capability: it reaps orphans and nothing
 *     else; no signal sent from inside the sandbox reaches it. Once ready, this process sends
 *     "<host pid>\n" with a pidfd of the init (SCM_RIGHTS) on --ready-fd (a unix socket) and
 *     exits 0; on failure the reason goes to stderr and it exits 1, leaving no process.
 *
 *   dsec-sandbox exec --pidfd N [--cgroup FILE]... [--user NAME | --uid N --gid N]
 *                     [--cwd DIR] [--seccomp FILE] [--fsize BYTES] [--env-fd N]
 *                     --status-fd N -- ARGV...
 *     Runs ARGV in the sandbox whose init --pidfd names (a pidfd cannot be reused: a dead
 *     init is "lost", never another process). Joins the cgroups and the init's IPC, UTS,
 *     network, PID, mount and cgroup namespaces, forks the command as a session leader,
 *     which joins the sandbox's user namespace, becomes the user (--user NAME is looked up in the
 *     sandbox's own /etc/passwd, as its root), keeps a container capability set (root only),
 *     enters --cwd, sets RLIMIT_FSIZE, no_new_privs and the seccomp program, and execs ARGV
 *     with the environment read from --env-fd (NAME=VALUE\0...; nothing else). On
 *     --status-fd it writes "status <wait status>\n" when the command ends, "lost\n" if
 *     the sandbox is gone, "nouser\n" if --user is unknown. Forwards SIGTERM/SIGINT/SIGHUP
 *     to the command's process group, and turns SIGUSR1 into SIGKILL for it: the host
 *     signals this helper, never a process group by number. The command is reaped only
 *     after forwarding has stopped, so the group's id cannot name anyone else meanwhile.
 *
 *   dsec-sandbox read --pidfd N [--cgroup FILE]... --max BYTES PATH
 *   dsec-sandbox write --pidfd N [--cgroup FILE]... --mode MODE --size BYTES PATH  (data on stdin)
 *     A file operation as the sandbox's root, inside its mount and user namespaces, in its
 *     cgroups (its CPU, memory and process count are the sandbox's); SIGTERM kills the
 *     operation, stopped or not (the sandbox can stop it: it is of its uid), and so does
 *     this process's death: paths and symlinks resolve in the sandbox's own tree, with its
 *     permissions. read writes the
 *     whole regular file (at most BYTES) to stdout; write replaces PATH atomically (a
 *     temporary name renamed into place), making missing parent directories (0755). Errors:
 *     "error <errno> <what>\n" on stderr and exit 2; "lost\n" and exit 3 if the sandbox is
 *     gone.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_CGROUPS 16
#define MAX_LOWERS 64
#define SANDBOX_NS \
    (CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWCGROUP)

extern char **environ;
static char *args_start, *args_end; /* our command line, rewritten by init */

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

static long number(const char *opt, const char *v) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (errno || *end || end == v) die("%s: not a number: %s", opt, v);
    return n;
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

/* inherited by init: the OOM killer spares it (needs CAP_SYS_RESOURCE, which some hosts'
 * root lacks; without it init is tiny anyway) */
static void spare_from_oom(void) {
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0 && write(fd, "-1000", 5) < 0) { /* EACCES without CAP_SYS_RESOURCE */ }
    if (fd >= 0) close(fd);
}

/* What /proc/PID/cmdline shows (readable by anyone who sees the process): our command line
 * names host paths (cgroups, the seccomp file, the sandbox's directory), so a process the
 * sandbox can see shows only `name`. */
/* what the sandbox sees of us in /proc: the command line and the comm */
static void rename_self(const char *name) {
    memset(args_start, 0, args_end - args_start);
    strncpy(args_start, name, args_end - args_start - 1);
    prctl(PR_SET_NAME, name, 0, 0, 0);
}

static void nondumpable(void) {
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) die("prctl(DUMPABLE)");
}

/* ---------------------------------------------------------------------------------------- */
/* capabilities                                                                              */

/* what root in a sandbox keeps, in its own user namespace: Docker's default set without
 * CAP_MKNOD (devices are the kernel's to refuse anyway: mknod needs it in the host's
 * namespace). Over the sandbox's mount, network, UTS, IPC and PID namespaces, which the host
 * owns, they give nothing. */
static const int keep_caps[] = {
    CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FSETID, CAP_FOWNER, CAP_NET_RAW, CAP_SETGID,
    CAP_SETUID, CAP_SETFCAP, CAP_SETPCAP, CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT, CAP_KILL,
    CAP_AUDIT_WRITE,
};

static unsigned long long keep_mask(void) {
    unsigned long long keep = 0;
    for (size_t i = 0; i < sizeof keep_caps / sizeof keep_caps[0]; i++) keep |= 1ULL << keep_caps[i];
    return keep;
}

static void set_caps(unsigned long long effective, unsigned long long permitted) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    for (int i = 0; i < 2; i++) {
        data[i].effective = (unsigned int)(effective >> (32 * i));
        data[i].permitted = (unsigned int)(permitted >> (32 * i));
    }
    if (syscall(SYS_capset, &hdr, data) < 0) die("capset");
}

static unsigned long long permitted_caps(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) < 0) die("capget");
    return (unsigned long long)data[0].permitted | (unsigned long long)data[1].permitted << 32;
}

/* keep only `keep` in the bounding set, clear the ambient and inheritable sets */
static void bound_caps(unsigned long long keep) {
    for (int c = 0; c <= CAP_LAST_CAP; c++)
        if (!(keep & (1ULL << c)) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            die("drop capability %d", c);
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* the sandbox's user namespace                                                              */

/* A user namespace mapping 0..count-1 to base..base+count-1, held by the returned fd. Made
 * by a short-lived child (a process in it could no longer mount as host root), whose maps
 * this process writes. */
static int make_userns(long base, long count) {
    int go[2], done[2];
    if (pipe2(go, O_CLOEXEC) < 0 || pipe2(done, O_CLOEXEC) < 0) die("pipe");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        char c = 0;
        close(go[1]);
        close(done[0]);
        if (unshare(CLONE_NEWUSER) < 0) _exit(1);
        if (write(done[1], &c, 1) != 1) _exit(1);
        if (read(go[0], &c, 1) < 0) _exit(1); /* held until the parent has the fd */
        _exit(0);
    }
    close(done[1]);
    close(go[0]);
    char c, path[64], map[64];
    if (read(done[0], &c, 1) != 1) die("make the user namespace");
    snprintf(map, sizeof map, "0 %ld %ld\n", base, count);
    snprintf(path, sizeof path, "/proc/%d/uid_map", pid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/gid_map", pid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("open %s", path);
    close(go[1]);
    close(done[0]);
    waitpid(pid, NULL, 0);
    return fd;
}

/* become uid/gid 0 of the user namespace just joined: the host's base uid */
static void be_sandbox_root(void) {
    if (setgroups(0, NULL) < 0) die("setgroups");
    if (setresgid(0, 0, 0) < 0) die("setresgid");
    if (setresuid(0, 0, 0) < 0) die("setresuid");
}

/* ---------------------------------------------------------------------------------------- */
/* init                                                                                      */

static void must_mount(const char *src, const char *dst, const char *type, unsigned long fl,
                       const char *data) {
    if (mount(src, dst, type, fl, data) < 0) die("mount %s on %s", type ? type : src, dst);
}

/* mount a clone of `src` on `dst` with the files' owners seen through `userns` */
static void idmapped(const char *src, const char *dst, int userns, unsigned long long attr) {
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0) die("open_tree %s", src);
    struct mount_attr ma = {.attr_set = attr | MOUNT_ATTR_IDMAP, .userns_fd = (unsigned)userns};
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &ma, sizeof ma) < 0)
        die("idmap %s", src);
    if (syscall(SYS_move_mount, fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        die("move_mount %s", dst);
    close(fd);
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

/* Host-wide knobs under /proc: read-only, and hide what tells about the host (Docker's
 * lists). Their owner (host root) is not mapped in the sandbox, which protects them already;
 * this is the second line. */
static void protect_proc(void) {
    static const char *readonly[] = {"proc/sys", "proc/sysrq-trigger", "proc/irq", "proc/bus",
                                     "proc/fs"};
    static const char *hidden[] = {"proc/kcore", "proc/keys", "proc/timer_list",
                                   "proc/sched_debug", "proc/latency_stats", "proc/acpi",
                                   "proc/scsi", "proc/asound", "proc/kallsyms", "proc/kmsg"};
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

/* per network namespace: low ports and ping for the sandbox's root, who is not root of the
 * namespace's owner */
static void net_sysctls(void) {
    write_file("proc/sys/net/ipv4/ip_unprivileged_port_start", "0");
    write_file("proc/sys/net/ipv4/ping_group_range", "0 2147483647");
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

/* files made on the overlay from here belong to the sandbox's root (an idmapped upper takes
 * only owners the sandbox maps); mounting still needs the capabilities this change drops
 * from the effective set, so they are raised again */
static void create_as(long uid) {
    setfsgid((gid_t)uid);
    setfsuid((uid_t)uid);
    unsigned long long p = permitted_caps();
    set_caps(p, p);
}

static void setup_root(const char *dir, char *lowers, long base, int userns, const char *host) {
    char opts[4096], *save = NULL;
    int n = 0, len;
    must_mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    if (chdir(dir) < 0) die("chdir to the sandbox directory");
    len = snprintf(opts, sizeof opts, "lowerdir=");
    for (char *p = strtok_r(lowers, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
        char dst[32];
        if (n == MAX_LOWERS) die("more than %d lower layers", MAX_LOWERS);
        snprintf(dst, sizeof dst, "m/%d", n);
        idmapped(p, dst, userns, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
        len += snprintf(opts + len, sizeof opts - len, "%sm/%d", n ? ":" : "", n);
        n++;
    }
    if (!n) die("no lower layer");
    idmapped("rw", "m/rw", userns, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
    /* relative paths: the sandbox's mountinfo shows no host path. volatile: the overlay
     * never syncs the upper's filesystem (without it, every sandbox's exit committed a
     * transaction of the node's whole btrfs: +3 ms a destroy, measured); a sandbox does not
     * outlive its host anyway, and fsync inside it returns at once */
    if (snprintf(opts + len, sizeof opts - len, ",upperdir=m/rw/upper,workdir=m/rw/work,volatile") >=
        (int)(sizeof opts - len))
        die("overlay options too long");
    create_as(base);
    must_mount("overlay", "rootfs", "overlay", MS_NODEV, opts);
    if (chdir("rootfs") < 0) die("chdir rootfs");
    mkdir("proc", 0555);
    must_mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    net_sysctls();
    mkdir("sys", 0555);
    must_mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    make_dev();
    protect_proc();
    mkdir("tmp", 01777);
    chmod("tmp", 01777); /* the umask applies to mkdir */
    if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root");
    if (umount2(".", MNT_DETACH) < 0) die("umount the old root");
    if (chdir("/") < 0) die("chdir /");
    if (sethostname(host, strlen(host)) < 0) die("sethostname");
    loopback_up();
}

/* PID 1 of the sandbox: reap orphans for ever. Every signal but SIGCHLD keeps its default
 * action and is not blocked, so the kernel drops it when it comes from inside the sandbox
 * (SIGKILL included); only the host can kill init. */
static _Noreturn void init_loop(void) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_SETMASK, &chld, NULL);
    for (;;) {
        siginfo_t info;
        if (sigwaitinfo(&chld, &info) < 0) continue;
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
    }
}

static void send_ready(int sock, pid_t pid, int pidfd) {
    char text[32];
    int n = snprintf(text, sizeof text, "%d\n", pid);
    struct iovec iov = {text, (size_t)n};
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &pidfd, sizeof(int));
    if (sendmsg(sock, &msg, 0) != n) die("report the init");
}

static int cmd_init(int argc, char **argv) {
    const char *dir = NULL, *host = "sandbox", *netns = NULL;
    char *lowers = NULL, *cgroups[MAX_CGROUPS];
    int ncg = 0, ready = -1;
    long base = -1, count = 65536;
    for (int i = 0; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("%s needs a value", a);
        if (!strcmp(a, "--dir")) dir = v;
        else if (!strcmp(a, "--lower")) lowers = (char *)v;
        else if (!strcmp(a, "--uid-base")) base = number(a, v);
        else if (!strcmp(a, "--uid-count")) count = number(a, v);
        else if (!strcmp(a, "--hostname")) host = v;
        else if (!strcmp(a, "--netns")) netns = v;
        else if (!strcmp(a, "--ready-fd")) ready = (int)number(a, v);
        else if (!strcmp(a, "--cgroup") && ncg < MAX_CGROUPS) cgroups[ncg++] = (char *)v;
        else die("unknown option %s", a);
    }
    errno = 0;
    if (!dir || !lowers || base <= 0 || count <= 0 || ready < 0)
        die("init needs --dir --lower --uid-base --ready-fd");
    nondumpable();
    spare_from_oom();
    join_cgroups(cgroups, ncg);
    int userns = make_userns(base, count);
    if (netns) {
        int fd = open(netns, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) die("enter the network namespace");
        close(fd);
    }
    int flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP;
    if (!netns) flags |= CLONE_NEWNET;
    if (unshare(flags) < 0) die("unshare");
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0) die("pipe");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(sync[0]);
        close(ready);
        setup_root(dir, lowers, base, userns, host);
        if (setns(userns, CLONE_NEWUSER) < 0) die("enter the user namespace");
        close(userns);
        be_sandbox_root();
        bound_caps(0);
        set_caps(0, 0);
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs");
        nondumpable(); /* changing uid made it so already; said again, as the contract */
        rename_self("init");
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null < 0) die("open /dev/null");
        if (write(sync[1], "1", 1) != 1) _exit(1);
        for (int i = 0; i < 3; i++) dup2(null, i);
        syscall(SYS_close_range, 3, ~0U, 0);
        init_loop();
    }
    close(sync[1]);
    close(userns);
    char ok;
    if (read(sync[0], &ok, 1) != 1) {
        waitpid(pid, NULL, 0);
        errno = 0;
        die("the sandbox did not start (see above)");
    }
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0); /* our child: cannot be another */
    if (pidfd < 0) {
        kill(pid, SIGKILL);
        die("pidfd_open");
    }
    send_ready(ready, pid, pidfd);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* exec                                                                                      */

static pid_t child = -1;

/* Wait for `child` to end, then block `signals` (whose handlers signal it by its pid or
 * group id) before reaping it: until then its id cannot be anyone else's. Its wait status. */
static int reap(const sigset_t *signals) {
    siginfo_t info;
    while (waitid(P_PID, (id_t)child, &info, WEXITED | WNOWAIT) < 0) /* ended: not reaped */
        if (errno != EINTR) die("wait");
    sigprocmask(SIG_BLOCK, signals, NULL);
    child = -1;
    int status;
    while (waitpid((pid_t)info.si_pid, &status, 0) < 0)
        if (errno != EINTR) die("wait");
    return status;
}

/* the command's group, while the command is unreaped (its id then cannot be reused) */
static void forward(int sig) {
    if (child > 0) kill(-child, sig == SIGUSR1 ? SIGKILL : sig);
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

/* NAME=VALUE\0... from fd, as an environment (NULL-terminated) */
static char **read_env(int fd) {
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf) die("malloc");
    for (;;) {
        if (len == cap && !(buf = realloc(buf, cap *= 2))) die("realloc");
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0) die("read the environment");
        if (n == 0) break;
        len += (size_t)n;
    }
    close(fd);
    size_t count = 0;
    for (size_t i = 0; i < len; i++) count += buf[i] == '\0';
    char **env = calloc(count + 1, sizeof *env);
    if (!env) die("calloc");
    for (size_t i = 0, k = 0; i < len && k < count; k++) {
        env[k] = buf + i;
        i += strlen(buf + i) + 1;
    }
    return env;
}

/* uid and primary gid of `name` in the sandbox's /etc/passwd (read as its root) */
static int lookup_user(const char *name, long *uid, long *gid) {
    int fd = open("/etc/passwd", O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > (1 << 20)) return 0;
    char *data = malloc((size_t)st.st_size + 1);
    ssize_t n = data ? read(fd, data, (size_t)st.st_size) : -1;
    close(fd);
    if (n < 0) return 0;
    data[n] = '\0';
    size_t want = strlen(name);
    for (char *line = data; line && *line;) {
        char *next = strchr(line, '\n');
        if (next) *next++ = '\0';
        char *f[4] = {line};
        int k = 1;
        for (char *p = line; *p && k < 4; p++)
            if (*p == ':') { *p = '\0'; f[k++] = p + 1; }
        if (k == 4 && strlen(f[0]) == want && !strcmp(f[0], name)) {
            char *end;
            *uid = strtol(f[2], &end, 10);
            *gid = strtol(f[3], &end, 10);
            return *uid >= 0 && *gid >= 0;
        }
        line = next;
    }
    return 0;
}

static void status_line(int fd, const char *fmt, long value) {
    char out[48];
    int n = snprintf(out, sizeof out, fmt, value);
    if (fd >= 0 && write(fd, out, n) != n) { /* the caller stopped listening: carry on */ }
}

static int cmd_exec(int argc, char **argv) {
    const char *cwd = "/", *seccomp = NULL, *user = NULL;
    char *cgroups[MAX_CGROUPS];
    int ncg = 0, status_fd = -1, env_fd = -1, pidfd = -1;
    long uid = 0, gid = 0, fsize = -1;
    int i = 0;
    for (; i < argc && strcmp(argv[i], "--"); i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("%s needs a value", a);
        if (!strcmp(a, "--pidfd")) pidfd = (int)number(a, v);
        else if (!strcmp(a, "--uid")) uid = number(a, v);
        else if (!strcmp(a, "--gid")) gid = number(a, v);
        else if (!strcmp(a, "--user")) user = v;
        else if (!strcmp(a, "--cwd")) cwd = v;
        else if (!strcmp(a, "--seccomp")) seccomp = v;
        else if (!strcmp(a, "--status-fd")) status_fd = (int)number(a, v);
        else if (!strcmp(a, "--env-fd")) env_fd = (int)number(a, v);
        else if (!strcmp(a, "--fsize")) fsize = number(a, v);
        else if (!strcmp(a, "--cgroup") && ncg < MAX_CGROUPS) cgroups[ncg++] = (char *)v;
        else die("unknown option %s", a);
    }
    errno = 0;
    if (i >= argc - 1 || pidfd < 0 || status_fd < 0) die("exec needs --pidfd --status-fd -- ARGV");
    nondumpable();
    char **cmd = argv + i + 1;
    char *empty[] = {NULL};
    char **env = env_fd >= 0 ? read_env(env_fd) : empty;
    unsigned short filter_len = seccomp ? read_seccomp(seccomp) : 0;
    join_cgroups(cgroups, ncg);
    if (setns(pidfd, SANDBOX_NS) < 0) {
        if (errno == ESRCH) {
            status_line(status_fd, "lost\n", 0);
            return 3;
        }
        die("enter the sandbox");
    }
    rename_self("dsec-exec"); /* the child is in the sandbox's sight until it execs */
    child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        setsid();
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (setns(pidfd, CLONE_NEWUSER) < 0) die("enter the user namespace");
        close(pidfd);
        be_sandbox_root();
        if (user && !lookup_user(user, &uid, &gid)) {
            status_line(status_fd, "nouser\n", 0);
            _exit(125);
        }
        fcntl(status_fd, F_SETFD, FD_CLOEXEC);
        if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0) die("setgid");
        bound_caps(keep_mask());
        if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0) die("setuid");
        if (uid == 0) set_caps(keep_mask(), keep_mask());
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
        environ = env; /* execvp searches this PATH */
        execvp(cmd[0], cmd);
        fprintf(stderr, "dsec: cannot run %s: %s\n", cmd[0], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1};
    struct sigaction sa = {0};
    sa.sa_handler = forward;
    sigset_t mask;
    sigemptyset(&mask);
    for (size_t k = 0; k < sizeof forwarded / sizeof forwarded[0]; k++) {
        sigaction(forwarded[k], &sa, NULL);
        sigaddset(&mask, forwarded[k]);
    }
    int status = reap(&mask);
    status_line(status_fd, "status %ld\n", status);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* files                                                                                     */

static void fail(const char *what) {
    fprintf(stderr, "error %d %s\n", errno, what);
    _exit(2);
}

/* our child, unreaped (its pid cannot be anyone else's) */
static void kill_child(int sig) {
    (void)sig;
    if (child > 0) kill(child, SIGKILL);
}

/* Continue as the sandbox's root in a child inside all its namespaces, as a command there
 * would be (so what /proc tells, /proc/self/net or /proc/self/cgroup say, is the sandbox's
 * own); this process waits and exits as the child does. */
static void enter_files(int pidfd, char **cgroups, int ncg) {
    join_cgroups(cgroups, ncg);
    if (setns(pidfd, SANDBOX_NS) < 0) {
        if (errno == ESRCH) {
            fputs("lost\n", stderr);
            _exit(3);
        }
        die("enter the sandbox");
    }
    rename_self("dsec-file"); /* the child is in the sandbox's sight */
    child = fork();
    if (child < 0) die("fork");
    if (child > 0) { /* SIGTERM (the host's timeout): SIGKILL the child, stopped or not */
        struct sigaction sa = {0};
        sa.sa_handler = kill_child;
        sigaction(SIGTERM, &sa, NULL);
        sigset_t term;
        sigemptyset(&term);
        sigaddset(&term, SIGTERM);
        int status = reap(&term);
        _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 2);
    }
    pid_t parent = getppid();
    if (setns(pidfd, CLONE_NEWUSER) < 0) die("enter the user namespace");
    close(pidfd);
    be_sandbox_root();
    /* after the uid change, which clears it; then the parent may already be gone */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0 || getppid() != parent) _exit(2);
    if (chdir("/") < 0) die("chdir /");
}

static int cmd_read(int pidfd, char **cgroups, int ncg, long max, const char *path) {
    enter_files(pidfd, cgroups, ncg);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC); /* a FIFO: not blocked */
    if (fd < 0) fail("open");
    struct stat st;
    if (fstat(fd, &st) < 0) fail("stat");
    if (!S_ISREG(st.st_mode)) {
        errno = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        fail("not a regular file");
    }
    if (st.st_size > max) {
        errno = EFBIG;
        fail("too large");
    }
    char buf[1 << 16];
    long total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0) fail("read");
        if (n == 0) break;
        if ((total += n) > max) {
            errno = EFBIG;
            fail("too large");
        }
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(1, buf + off, (size_t)(n - off));
            if (w < 0) fail("write");
            off += w;
        }
    }
    return 0;
}

/* an fd of directory `path` (absolute), each missing component made 0755 */
static int make_parents(char *path) {
    int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    char *save = NULL;
    for (char *p = strtok_r(path, "/", &save); p; p = strtok_r(NULL, "/", &save)) {
        int next = openat(fd, p, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (next < 0 && errno == ENOENT) {
            if (mkdirat(fd, p, 0755) < 0 && errno != EEXIST) fail("mkdir");
            next = openat(fd, p, O_PATH | O_DIRECTORY | O_CLOEXEC);
        }
        if (next < 0) fail("parent");
        close(fd);
        fd = next;
    }
    return fd;
}

static int cmd_write(int pidfd, char **cgroups, int ncg, long mode, long size, char *path) {
    enter_files(pidfd, cgroups, ncg);
    char *slash = strrchr(path, '/');
    const char *name = slash + 1;
    *slash = '\0';
    int dir = make_parents(path);
    char tmp[NAME_MAX + 16];
    if (snprintf(tmp, sizeof tmp, ".%s.dsec-tmp", name) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        fail("name");
    }
    unlinkat(dir, tmp, 0); /* whatever is there (a FIFO, say) goes; ours is new */
    int fd = openat(dir, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) fail("create");
    char buf[1 << 16];
    long total = 0;
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n < 0) fail("read");
        if (n == 0) break;
        total += n;
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(fd, buf + off, (size_t)(n - off));
            if (w < 0) {
                unlinkat(dir, tmp, 0);
                fail("write");
            }
            off += w;
        }
    }
    if (total != size) {
        unlinkat(dir, tmp, 0);
        errno = EIO;
        fail("short data");
    }
    if (fchmod(fd, (mode_t)(mode & 0777)) < 0 || close(fd) < 0) fail("close");
    if (renameat(dir, tmp, dir, name) < 0) {
        int e = errno;
        unlinkat(dir, tmp, 0);
        errno = e;
        fail("rename");
    }
    return 0;
}

static int cmd_file(const char *op, int argc, char **argv) {
    int pidfd = -1, ncg = 0;
    long max = 0, mode = 0644, size = -1;
    char *cgroups[MAX_CGROUPS];
    int i = 0;
    for (; i + 1 < argc && !strncmp(argv[i], "--", 2); i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--pidfd")) pidfd = (int)number(a, v);
        else if (!strcmp(a, "--cgroup") && ncg < MAX_CGROUPS) cgroups[ncg++] = (char *)v;
        else if (!strcmp(a, "--max")) max = number(a, v);
        else if (!strcmp(a, "--mode")) mode = number(a, v);
        else if (!strcmp(a, "--size")) size = number(a, v);
        else die("unknown option %s", a);
    }
    errno = 0;
    if (pidfd < 0 || i != argc - 1 || argv[i][0] != '/') die("%s needs --pidfd and a path", op);
    nondumpable();
    if (!strcmp(op, "read")) return cmd_read(pidfd, cgroups, ncg, max, argv[i]);
    if (size < 0) die("write needs --size");
    return cmd_write(pidfd, cgroups, ncg, mode, size, argv[i]);
}

int main(int argc, char **argv) {
    args_start = argv[0];
    args_end = argv[argc - 1] + strlen(argv[argc - 1]) + 1;
    for (int i = 0; i < argc; i++) /* copies: rename_self wipes the originals */
        if (!(argv[i] = strdup(argv[i]))) die("strdup");
    if (argc >= 2 && !strcmp(argv[1], "init")) return cmd_init(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "exec")) return cmd_exec(argc - 2, argv + 2);
    if (argc >= 2 && (!strcmp(argv[1], "read") || !strcmp(argv[1], "write")))
        return cmd_file(argv[1], argc - 2, argv + 2);
    fprintf(stderr, "usage: dsec-sandbox init|exec|read|write ... (see the source's header)\n");
    return 2;
}
