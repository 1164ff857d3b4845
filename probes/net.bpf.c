/* Sockets of traced threads, and every interface's packets.
 *
 * sock:sock_recv_length / sock_send_length fire as a receive or send returns, in the
 * calling thread: a traced thread's bytes and calls are counted per (bucket, thread,
 * socket, direction), and the time from its last send on a socket to its next receive
 * there (a request answered) per (bucket, thread, socket).  The first time a thread
 * uses a socket, or when the socket's peer changed since, the socket is described once
 * (family, peer address or UNIX path, route's interface) in the ring buffer.
 *
 * Sockets are named by their inode (what /proc/PID/fd shows), never by a pointer.  The
 * struct offsets come from the running kernel's BTF (tracer/kernel_btf.py): the headers
 * bcc compiles against may be another kernel's.  NET_OFFSETS 0: the kernel has no BTF,
 * sockets are not counted, the interfaces are.
 *
 * tcp:tcp_retransmit_skb (timers, softirqs) counts per (bucket, socket) for the sockets
 * a traced thread used.  net:net_dev_xmit / net:netif_receive_skb count every packet of
 * the machine per (bucket, interface, direction, task): kept to one hash update each. */
#ifndef PROBE_NET
#error "PROBE_NET must be defined by the loader"
#endif
#ifndef NET_BUCKET_NS
#error "NET_BUCKET_NS must be defined by the loader"
#endif
#ifndef NET_ENTRIES
#error "NET_ENTRIES must be defined by the loader"
#endif
#ifndef NET_SOCKETS
#error "NET_SOCKETS must be defined by the loader"
#endif
#ifndef NET_RECV
#error "NET_RECV must be defined by the loader"
#endif
#ifndef NET_SEND
#error "NET_SEND must be defined by the loader"
#endif
#ifndef NET_OFFSETS
#error "NET_OFFSETS must be defined by the loader"
#endif
#ifndef OFF_SKC_DADDR
#error "OFF_SKC_DADDR must be defined by the loader"
#endif
#ifndef OFF_SKC_DPORT
#error "OFF_SKC_DPORT must be defined by the loader"
#endif
#ifndef OFF_SKC_V6_DADDR
#error "OFF_SKC_V6_DADDR must be defined by the loader"
#endif
#ifndef OFF_SKC_BOUND_DEV_IF
#error "OFF_SKC_BOUND_DEV_IF must be defined by the loader"
#endif
#ifndef OFF_SK_SOCKET
#error "OFF_SK_SOCKET must be defined by the loader"
#endif
#ifndef OFF_SK_DST_CACHE
#error "OFF_SK_DST_CACHE must be defined by the loader"
#endif
#ifndef OFF_SOCKET_FILE
#error "OFF_SOCKET_FILE must be defined by the loader"
#endif
#ifndef OFF_FILE_INODE
#error "OFF_FILE_INODE must be defined by the loader"
#endif
#ifndef OFF_INODE_INO
#error "OFF_INODE_INO must be defined by the loader"
#endif
#ifndef OFF_DST_DEV
#error "OFF_DST_DEV must be defined by the loader"
#endif
#ifndef OFF_NETDEV_NAME
#error "OFF_NETDEV_NAME must be defined by the loader"
#endif
#ifndef OFF_UNIX_PEER
#error "OFF_UNIX_PEER must be defined by the loader"
#endif
#ifndef OFF_UNIX_ADDR
#error "OFF_UNIX_ADDR must be defined by the loader"
#endif
#ifndef OFF_UNIX_ADDRESS_LEN
#error "OFF_UNIX_ADDRESS_LEN must be defined by the loader"
#endif
#ifndef OFF_UNIX_ADDRESS_PATH
#error "OFF_UNIX_ADDRESS_PATH must be defined by the loader"
#endif

#define NET_AF_UNIX 1
#define NET_AF_INET 2
#define NET_AF_INET6 10
#define NET_MSG_PEEK 2
#define NET_PATH_MAX 108

struct net_socket_event {
    u64 ts_ns;
    u64 socket; /* its inode */
    u32 tid;
    u32 pid;
    u16 family;
    u16 protocol;
    u16 port;     /* the peer's, host order */
    u16 addr_len; /* bytes of addr: 4, 16, a UNIX address's length (0: unnamed) */
    s32 ifindex;  /* sk_bound_dev_if, when the route names no device */
    char interface[16];
    u8 addr[NET_PATH_MAX]; /* IPv4/IPv6 address, or the peer's sun_path */
};

struct net_key {
    u64 bucket; /* bpf_ktime_get_ns() / NET_BUCKET_NS */
    u64 ino;
    u32 tid;
    u32 direction;
};

struct net_count {
    u64 bytes;
    u64 calls;
    u64 requests; /* receives that answered a send (NET_RECV keys only) */
    u64 latency;  /* their sum of send -> receive, ns */
    u64 max_latency;
    u32 pid;
    u32 pad;
    char comm[16];
};

struct net_seen {
    u64 ino;
    u64 peer; /* what the socket's peer was when described (address and port, or the peer sock) */
};

struct net_pending_key {
    u64 ino;
    u32 tid;
    u32 pad;
};

struct retransmit_key {
    u64 bucket;
    u64 ino;
};

struct retransmit_count {
    u64 count;
};

struct device_key {
    u64 bucket;
    char ifname[16];
    u32 tid;
    u32 direction;
};

struct device_count {
    u64 bytes;
    u64 packets;
    u32 pid;
    u32 pad;
    char comm[16];
};

BPF_RINGBUF_OUTPUT(net_events, RINGBUF_PAGES);
/* Drained whole at every flush (tracer/collectors/net.py); past it, counted as lost. */
BPF_HASH(net_counts, struct net_key, struct net_count, NET_ENTRIES);
BPF_HASH(retransmit_counts, struct retransmit_key, struct retransmit_count, NET_ENTRIES);
BPF_HASH(device_counts, struct device_key, struct device_count, NET_ENTRIES);
/* The sockets traced threads used (by the kernel's pointer, which stays in the kernel),
 * and each thread's last unanswered send per socket: the least recently used go first. */
BPF_TABLE("lru_hash", u64, struct net_seen, net_sockets, NET_SOCKETS);
BPF_TABLE("lru_hash", struct net_pending_key, u64, net_pending, NET_SOCKETS);

static __always_inline u64 read_u64(const void *base, u32 off)
{
    u64 v = 0;
    if (base)
        bpf_probe_read_kernel(&v, sizeof(v), (const char *)base + off);
    return v;
}

/* The socket's inode: sk->sk_socket->file->f_inode->i_ino (0 where one is missing). */
static __always_inline u64 socket_inode(const void *sk)
{
    const void *sock = (const void *)read_u64(sk, OFF_SK_SOCKET);
    const void *file = (const void *)read_u64(sock, OFF_SOCKET_FILE);
    const void *inode = (const void *)read_u64(file, OFF_FILE_INODE);
    return read_u64(inode, OFF_INODE_INO);
}

/* What names the peer now: address and port (IPv6: folded), or a UNIX socket's peer. */
static __always_inline u64 peer_signature(const void *sk, u16 family)
{
    if (family == NET_AF_UNIX)
        return read_u64(sk, OFF_UNIX_PEER);
    u32 port = 0;
    bpf_probe_read_kernel(&port, sizeof(u16), (const char *)sk + OFF_SKC_DPORT);
    if (family == NET_AF_INET6)
        return read_u64(sk, OFF_SKC_V6_DADDR) ^ read_u64(sk, OFF_SKC_V6_DADDR + 8) ^ port;
    u32 addr = 0;
    bpf_probe_read_kernel(&addr, sizeof(addr), (const char *)sk + OFF_SKC_DADDR);
    return (u64)addr << 16 | port;
}

/* Describe a socket: its peer and the device its route goes out of. */
static __always_inline void describe_socket(const void *sk, u64 ino, u16 family, u16 protocol)
{
    struct net_socket_event *e = net_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_lost(PROBE_NET);
        return;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts_ns = bpf_ktime_get_ns();
    e->socket = ino;
    e->tid = current_tid();
    e->pid = current_tgid();
    e->family = family;
    e->protocol = protocol;
    if (family == NET_AF_UNIX) {
        const void *peer = (const void *)read_u64(sk, OFF_UNIX_PEER);
        const void *address = (const void *)read_u64(peer, OFF_UNIX_ADDR);
        if (address) {
            int len = 0;
            bpf_probe_read_kernel(&len, sizeof(len), (const char *)address + OFF_UNIX_ADDRESS_LEN);
            e->addr_len = len > 2 ? len - 2 : 0; /* less sun_family */
            bpf_probe_read_kernel(e->addr, sizeof(e->addr), (const char *)address + OFF_UNIX_ADDRESS_PATH);
        }
    } else {
        u16 port = 0;
        bpf_probe_read_kernel(&port, sizeof(port), (const char *)sk + OFF_SKC_DPORT);
        e->port = bpf_ntohs(port);
        if (family == NET_AF_INET6) {
            e->addr_len = 16;
            bpf_probe_read_kernel(e->addr, 16, (const char *)sk + OFF_SKC_V6_DADDR);
        } else if (family == NET_AF_INET) {
            e->addr_len = 4;
            bpf_probe_read_kernel(e->addr, 4, (const char *)sk + OFF_SKC_DADDR);
        }
        const void *dst = (const void *)read_u64(sk, OFF_SK_DST_CACHE);
        const void *dev = (const void *)read_u64(dst, OFF_DST_DEV);
        if (dev)
            bpf_probe_read_kernel(e->interface, sizeof(e->interface), (const char *)dev + OFF_NETDEV_NAME);
        bpf_probe_read_kernel(&e->ifindex, sizeof(e->ifindex), (const char *)sk + OFF_SKC_BOUND_DEV_IF);
    }
    net_events.ringbuf_submit(e, submit_flags(PROBE_NET));
}

/* A traced thread's receive or send of `bytes` on `sk` returned now. */
static __always_inline int count_socket_io(const void *sk, u16 family, u16 protocol, int ret, int flags, u32 direction)
{
    if (!NET_OFFSETS || ret <= 0 || (direction == NET_RECV && (flags & NET_MSG_PEEK)))
        return 0;
    u32 tid = current_tid();
    if (!is_traced(tid))
        return 0;
    u64 ino = socket_inode(sk);
    if (!ino)
        return 0;
    u64 sk_key = (u64)sk;
    struct net_seen now_seen = {.ino = ino, .peer = peer_signature(sk, family)};
    struct net_seen *seen = net_sockets.lookup(&sk_key);
    if (!seen || seen->ino != now_seen.ino || seen->peer != now_seen.peer) {
        net_sockets.update(&sk_key, &now_seen);
        describe_socket(sk, ino, family, protocol);
    }
    u64 now = bpf_ktime_get_ns();
    struct net_pending_key pk = {.ino = ino, .tid = tid};
    u64 latency = 0;
    if (direction == NET_SEND) {
        net_pending.update(&pk, &now);
    } else {
        u64 *sent = net_pending.lookup(&pk);
        if (sent && *sent) {
            latency = now - *sent;
            net_pending.delete(&pk);
        }
    }
    struct net_key k = {.bucket = now / NET_BUCKET_NS, .ino = ino, .tid = tid, .direction = direction};
    struct net_count fresh = {};
    struct net_count *c = net_counts.lookup_or_try_init(&k, owned_entry(&fresh, &fresh.pid, fresh.comm));
    if (!c) {
        count_lost(PROBE_NET);
        return 0;
    }
    __sync_fetch_and_add(&c->bytes, ret);
    __sync_fetch_and_add(&c->calls, 1);
    if (latency) {
        __sync_fetch_and_add(&c->requests, 1);
        __sync_fetch_and_add(&c->latency, latency);
        if (latency > c->max_latency) /* a rare race between two threads keeps the smaller */
            c->max_latency = latency;
    }
    return 0;
}

TRACEPOINT_PROBE(sock, sock_recv_length)
{
    return count_socket_io(args->sk, args->family, args->protocol, args->ret, args->flags, NET_RECV);
}

TRACEPOINT_PROBE(sock, sock_send_length)
{
    return count_socket_io(args->sk, args->family, args->protocol, args->ret, args->flags, NET_SEND);
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    u64 sk_key = (u64)args->skaddr;
    struct net_seen *seen = net_sockets.lookup(&sk_key);
    if (!seen)
        return 0;
    struct retransmit_key k = {.bucket = bpf_ktime_get_ns() / NET_BUCKET_NS, .ino = seen->ino};
    struct retransmit_count fresh = {};
    struct retransmit_count *c = retransmit_counts.lookup_or_try_init(&k, &fresh);
    if (!c) {
        count_lost(PROBE_NET);
        return 0;
    }
    __sync_fetch_and_add(&c->count, 1);
    return 0;
}

/* A packet of `len` bytes through interface `ifname`, `task` when sent in task context
 * (the sender is `current`).  Receives run in softirq, and so do sends of ACKs and
 * retransmits: there the task on the CPU is not the sender, so they name none. */
static __always_inline int count_packet(const char *ifname, u32 len, u32 direction, int task)
{
    u64 id = task ? bpf_get_current_pid_tgid() : 0;
    if (id >> 32 == SELF_TGID && id) /* the recorder never counts itself */
        return 0;
    struct device_key k = {.bucket = bpf_ktime_get_ns() / NET_BUCKET_NS, .tid = (u32)id, .direction = direction};
    __builtin_memcpy(k.ifname, ifname, sizeof(k.ifname));
    struct device_count fresh = {}; /* outside task context no task is named */
    struct device_count *c =
        device_counts.lookup_or_try_init(&k, id ? owned_entry(&fresh, &fresh.pid, fresh.comm) : &fresh);
    if (!c) {
        count_lost(PROBE_NET);
        return 0;
    }
    __sync_fetch_and_add(&c->bytes, len);
    __sync_fetch_and_add(&c->packets, 1);
    return 0;
}

TRACEPOINT_PROBE(net, net_dev_xmit)
{
    if (args->rc != 0)
        return 0;
    char ifname[16] = {};
    TP_DATA_LOC_READ_STR(ifname, name, sizeof(ifname));
    /* task context when the arguments lie where sched_switch's did on this CPU
     * (probes/sched.bpf.c task_context_args; the sched probe is always loaded, first) */
    u32 zero = 0;
    u64 *task_args = task_context_args.lookup(&zero);
    return count_packet(ifname, args->len, NET_SEND, task_args && *task_args == (u64)args);
}

TRACEPOINT_PROBE(net, netif_receive_skb)
{
    char ifname[16] = {};
    TP_DATA_LOC_READ_STR(ifname, name, sizeof(ifname));
    return count_packet(ifname, args->len, NET_RECV, 0);
}
