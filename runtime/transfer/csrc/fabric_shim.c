/*
 * pdflow's thin layer over libfabric for the `rdma` transfer backend. libfabric's data-path calls
 * (fi_write, fi_mr_reg, fi_cq_read, ...) are static inline functions over per-object operation
 * tables, so Rust cannot call them directly; this file wraps the few that pdflow uses behind
 * plain functions. libfabric itself is opened at run time (dlopen of libfabric.so.1): a build
 * with the feature runs on a host without the library, and reports the backend unavailable.
 *
 * Two endpoint types, chosen by the caller per domain: reliable connected endpoints (FI_EP_MSG:
 * an RC queue pair on the verbs provider, a TCP connection on the software `tcp` provider), and
 * reliable datagram endpoints (FI_EP_RDM: AWS's `efa`, or `tcp;ofi_rxm` in software), which have
 * no connect step: the writer inserts the target's address in an address vector (FI_AV_TABLE)
 * and names it in every write. Both kinds live in a pf_conn. The domain is opened in the memory
 * registration modes a verbs NIC requires: FI_MR_LOCAL (local buffers registered, their
 * descriptors passed), FI_MR_VIRT_ADDR (remote addresses are virtual addresses), FI_MR_ALLOCATED
 * and FI_MR_PROV_KEY (the provider chooses each region's key). Writes ask for delivery
 * completion: a completion means the bytes are in the target's memory, and a write the target
 * refuses (a revoked key) completes in error.
 *
 * Every function returns 0 (or a count) on success and a negative libfabric error code on
 * failure; pf_strerror names it. Messages about the failure go into the caller's buffer.
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define PF_API_VERSION FI_VERSION(1, 9)
#define PF_MR_MODE (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY)
#define PF_CM_DATA_MAX 256

/* The exported libfabric functions pdflow needs (the rest are inline over the objects). */
static int (*p_getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *, struct fi_info **);
static void (*p_freeinfo)(struct fi_info *);
static struct fi_info *(*p_dupinfo)(const struct fi_info *);
static int (*p_fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
static const char *(*p_strerror)(int);
static void *lib;

static void say(char *err, size_t n, const char *fmt, ...) {
    if (!err || n == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

int pf_load(char *err, size_t n) {
    if (lib) return 0;
    void *h = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        say(err, n, "%s", dlerror());
        return -FI_ENOSYS;
    }
    p_getinfo = dlsym(h, "fi_getinfo");
    p_freeinfo = dlsym(h, "fi_freeinfo");
    p_dupinfo = dlsym(h, "fi_dupinfo");
    p_fabric = dlsym(h, "fi_fabric");
    p_strerror = dlsym(h, "fi_strerror");
    if (!p_getinfo || !p_freeinfo || !p_dupinfo || !p_fabric || !p_strerror) {
        say(err, n, "libfabric.so.1 lacks fi_getinfo/fi_fabric: too old a libfabric");
        dlclose(h);
        return -FI_ENOSYS;
    }
    lib = h;
    return 0;
}

const char *pf_strerror(int code) {
    if (!lib) return "libfabric is not loaded";
    return p_strerror(code < 0 ? -code : code);
}

/* The fabric and domain of one process's endpoints, with the info they came from. */
typedef struct pf_domain {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
} pf_domain;

/* A listening passive endpoint (D) and its event queue. */
typedef struct pf_listener {
    pf_domain *dom;
    struct fid_eq *eq;
    struct fid_pep *pep;
} pf_listener;

/* An endpoint with its own completion queue: connected (with an event queue), or reliable
 * datagram (with an address vector and, on the writer's side, the one peer it writes to). */
typedef struct pf_conn {
    struct fid_eq *eq;
    struct fid_cq *cq;
    struct fid_ep *ep;
    struct fid_av *av;
    fi_addr_t peer;
} pf_conn;

/* A connection request waiting for pf_accept or pf_reject. */
typedef struct pf_conn_req {
    struct fi_info *info;
} pf_conn_req;

static struct fi_info *hints_for(const char *prov, int rdm) {
    struct fi_info *h = p_dupinfo(NULL);
    if (!h) return NULL;
    h->ep_attr->type = rdm ? FI_EP_RDM : FI_EP_MSG;
    if (rdm) h->domain_attr->av_type = FI_AV_TABLE;
    h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    h->domain_attr->mr_mode = PF_MR_MODE;
    h->domain_attr->threading = FI_THREAD_SAFE;
    h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    if (prov && *prov) h->fabric_attr->prov_name = strdup(prov);
    return h;
}

int pf_domain_open(const char *prov, const char *node, int rdm, pf_domain **out, char *err, size_t n) {
    *out = NULL;
    if (!lib) {
        say(err, n, "libfabric is not loaded");
        return -FI_ENOSYS;
    }
    struct fi_info *hints = hints_for(prov, rdm);
    if (!hints) return -FI_ENOMEM;
    struct fi_info *info = NULL;
    if (node && !*node) node = NULL;
    int rc = p_getinfo(PF_API_VERSION, node, NULL, node ? FI_SOURCE : 0, hints, &info);
    p_freeinfo(hints);
    if (rc) {
        say(err, n, "no %s provider with reliable %s RMA on %s: %s", prov && *prov ? prov : "libfabric",
            rdm ? "datagram" : "connected", node ? node : "this host", p_strerror(-rc));
        return rc;
    }
    /* Run the provider in the registration modes a verbs NIC requires, whether or not this
     * provider needs them: the path that runs here is the path a NIC takes. */
    info->domain_attr->mr_mode |= PF_MR_MODE;
    pf_domain *d = calloc(1, sizeof *d);
    if (!d) {
        p_freeinfo(info);
        return -FI_ENOMEM;
    }
    d->info = info;
    rc = p_fabric(info->fabric_attr, &d->fabric, NULL);
    if (rc) {
        say(err, n, "fi_fabric(%s): %s", info->fabric_attr->prov_name, p_strerror(-rc));
        goto fail;
    }
    rc = fi_domain(d->fabric, info, &d->domain, NULL);
    if (rc) {
        say(err, n, "fi_domain(%s): %s", info->domain_attr->name, p_strerror(-rc));
        goto fail;
    }
    *out = d;
    return 0;
fail:
    if (d->fabric) fi_close(&d->fabric->fid);
    p_freeinfo(info);
    free(d);
    return rc;
}

void pf_domain_describe(const pf_domain *d, char *prov, size_t prov_n, char *dom, size_t dom_n, uint64_t *mr_mode,
                        uint64_t *max_msg, uint64_t *key_size) {
    say(prov, prov_n, "%s", d->info->fabric_attr->prov_name ? d->info->fabric_attr->prov_name : "?");
    say(dom, dom_n, "%s", d->info->domain_attr->name ? d->info->domain_attr->name : "?");
    *mr_mode = d->info->domain_attr->mr_mode;
    *max_msg = d->info->ep_attr->max_msg_size;
    *key_size = d->info->domain_attr->mr_key_size;
}

void pf_domain_close(pf_domain *d) {
    if (!d) return;
    if (d->domain) fi_close(&d->domain->fid);
    if (d->fabric) fi_close(&d->fabric->fid);
    p_freeinfo(d->info);
    free(d);
}

static int open_eq(pf_domain *d, struct fid_eq **eq) {
    struct fi_eq_attr attr = {.size = 64, .wait_obj = FI_WAIT_UNSPEC};
    return fi_eq_open(d->fabric, &attr, eq, NULL);
}

int pf_listen(pf_domain *d, pf_listener **out, void *name, size_t *namelen, char *err, size_t n) {
    *out = NULL;
    pf_listener *l = calloc(1, sizeof *l);
    if (!l) return -FI_ENOMEM;
    l->dom = d;
    int rc = open_eq(d, &l->eq);
    if (rc) goto fail;
    rc = fi_passive_ep(d->fabric, d->info, &l->pep, NULL);
    if (rc) goto fail;
    rc = fi_pep_bind(l->pep, &l->eq->fid, 0);
    if (rc) goto fail;
    rc = fi_listen(l->pep);
    if (rc) goto fail;
    rc = fi_getname(&l->pep->fid, name, namelen);
    if (rc) goto fail;
    *out = l;
    return 0;
fail:
    say(err, n, "cannot listen for RDMA connections: %s", p_strerror(-rc));
    if (l->pep) fi_close(&l->pep->fid);
    if (l->eq) fi_close(&l->eq->fid);
    free(l);
    return rc;
}

void pf_listener_close(pf_listener *l) {
    if (!l) return;
    fi_close(&l->pep->fid);
    fi_close(&l->eq->fid);
    free(l);
}

/* Waits up to timeout_ms for a connection request. Returns 1 with *req and its connection data,
 * 0 when none came, or an error. */
int pf_listener_wait(pf_listener *l, int timeout_ms, pf_conn_req **req, void *data, size_t *data_len) {
    *req = NULL;
    union {
        struct fi_eq_cm_entry entry;
        uint8_t bytes[sizeof(struct fi_eq_cm_entry) + PF_CM_DATA_MAX];
    } buf;
    uint32_t event = 0;
    ssize_t got = fi_eq_sread(l->eq, &event, &buf, sizeof buf, timeout_ms, 0);
    if (got == -FI_EAGAIN || got == -FI_ETIMEDOUT) return 0;
    if (got == -FI_EAVAIL) {
        struct fi_eq_err_entry e = {0};
        fi_eq_readerr(l->eq, &e, 0);
        return 0;
    }
    if (got < 0) return (int)got;
    if (event != FI_CONNREQ) {
        if (buf.entry.info) p_freeinfo(buf.entry.info);
        return 0;
    }
    size_t have = (size_t)got > sizeof(struct fi_eq_cm_entry) ? (size_t)got - sizeof(struct fi_eq_cm_entry) : 0;
    if (have > *data_len) have = *data_len;
    memcpy(data, buf.entry.data, have);
    *data_len = have;
    pf_conn_req *r = calloc(1, sizeof *r);
    if (!r) {
        p_freeinfo(buf.entry.info);
        return -FI_ENOMEM;
    }
    r->info = buf.entry.info;
    *req = r;
    return 1;
}

int pf_reject(pf_listener *l, pf_conn_req *req) {
    int rc = fi_reject(l->pep, req->info->handle, NULL, 0);
    p_freeinfo(req->info);
    free(req);
    return rc;
}

/* Closes the connection's endpoint only: from its return no byte moves through it. The queues
 * stay until pf_conn_close (a thread may be waiting on them). */
void pf_conn_close_ep(pf_conn *c) {
    if (!c || !c->ep) return;
    fi_close(&c->ep->fid);
    c->ep = NULL;
}

void pf_conn_close(pf_conn *c) {
    if (!c) return;
    if (c->ep) fi_close(&c->ep->fid);
    if (c->av) fi_close(&c->av->fid);
    if (c->cq) fi_close(&c->cq->fid);
    if (c->eq) fi_close(&c->eq->fid);
    free(c);
}

/* A connection object: an endpoint on info with its completion queue, and an event queue
 * (connected: rdm = 0) or an address vector (reliable datagram: rdm = 1). The completion queue
 * has a wait object: a thread waiting on it (fi_cq_sread) drives the provider's progress for a
 * software provider, and sleeps until something completes. */
static int conn_new(pf_domain *d, struct fi_info *info, int rdm, pf_conn **out) {
    pf_conn *c = calloc(1, sizeof *c);
    if (!c) return -FI_ENOMEM;
    c->peer = FI_ADDR_UNSPEC;
    struct fi_cq_attr cq_attr = {.size = 0, .format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_UNSPEC};
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE, .count = 4};
    int rc = rdm ? fi_av_open(d->domain, &av_attr, &c->av, NULL) : open_eq(d, &c->eq);
    if (!rc) rc = fi_cq_open(d->domain, &cq_attr, &c->cq, NULL);
    if (!rc) rc = fi_endpoint(d->domain, info, &c->ep, NULL);
    if (!rc) rc = rdm ? fi_ep_bind(c->ep, &c->av->fid, 0) : fi_ep_bind(c->ep, &c->eq->fid, 0);
    if (!rc) rc = fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV);
    if (!rc) rc = fi_enable(c->ep);
    if (rc) {
        pf_conn_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

/* Waits for FI_CONNECTED on the connection's event queue. */
static int await_connected(pf_conn *c, int timeout_ms, char *err, size_t n) {
    uint8_t buf[sizeof(struct fi_eq_cm_entry) + PF_CM_DATA_MAX];
    uint32_t event = 0;
    ssize_t got = fi_eq_sread(c->eq, &event, buf, sizeof buf, timeout_ms, 0);
    if (got == -FI_EAVAIL) {
        struct fi_eq_err_entry e = {0};
        fi_eq_readerr(c->eq, &e, 0);
        say(err, n, "the connection was refused: %s", p_strerror(e.err));
        return e.err ? -e.err : -FI_ECONNREFUSED;
    }
    if (got == -FI_EAGAIN || got == -FI_ETIMEDOUT) {
        say(err, n, "no answer to the connection within %d ms", timeout_ms);
        return -FI_ETIMEDOUT;
    }
    if (got < 0) {
        say(err, n, "connecting: %s", p_strerror((int)-got));
        return (int)got;
    }
    if (event != FI_CONNECTED) {
        say(err, n, "the peer answered the connection with event %u instead of connected", event);
        return -FI_ECONNREFUSED;
    }
    return 0;
}

int pf_accept(pf_listener *l, pf_conn_req *req, int timeout_ms, pf_conn **out, char *err, size_t n) {
    *out = NULL;
    pf_conn *c = NULL;
    req->info->domain_attr->mr_mode |= PF_MR_MODE;
    int rc = conn_new(l->dom, req->info, 0, &c);
    if (!rc) rc = fi_accept(c->ep, NULL, 0);
    if (rc) say(err, n, "accepting a connection: %s", p_strerror(-rc));
    if (!rc) rc = await_connected(c, timeout_ms, err, n);
    p_freeinfo(req->info);
    free(req);
    if (rc) {
        pf_conn_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

int pf_connect(pf_domain *d, const void *name, size_t namelen, const void *data, size_t data_len, int timeout_ms,
               pf_conn **out, char *err, size_t n) {
    *out = NULL;
    struct fi_info *info = p_dupinfo(d->info);
    if (!info) return -FI_ENOMEM;
    free(info->dest_addr);
    info->dest_addr = malloc(namelen);
    if (!info->dest_addr) {
        p_freeinfo(info);
        return -FI_ENOMEM;
    }
    memcpy(info->dest_addr, name, namelen);
    info->dest_addrlen = namelen;
    pf_conn *c = NULL;
    int rc = conn_new(d, info, 0, &c);
    p_freeinfo(info);
    if (rc) {
        say(err, n, "opening an endpoint: %s", p_strerror(-rc));
        return rc;
    }
    rc = fi_connect(c->ep, name, data, data_len);
    if (rc) say(err, n, "connecting: %s", p_strerror(-rc));
    if (!rc) rc = await_connected(c, timeout_ms, err, n);
    if (rc) {
        pf_conn_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

/* Opens a reliable datagram endpoint that peers write to (D); its address goes into name. */
int pf_rdm_open(pf_domain *d, pf_conn **out, void *name, size_t *namelen, char *err, size_t n) {
    *out = NULL;
    pf_conn *c = NULL;
    int rc = conn_new(d, d->info, 1, &c);
    if (!rc) {
        rc = fi_getname(&c->ep->fid, name, namelen);
        if (rc) pf_conn_close(c);
    }
    if (rc) {
        say(err, n, "opening a reliable datagram endpoint: %s", p_strerror(-rc));
        return rc;
    }
    *out = c;
    return 0;
}

/* Opens a reliable datagram endpoint that writes to the one at name (P): the address goes into
 * its address vector, and every write names it. No byte moves and nothing is checked here. */
int pf_rdm_reach(pf_domain *d, const void *name, size_t namelen, pf_conn **out, char *err, size_t n) {
    *out = NULL;
    pf_conn *c = NULL;
    int rc = conn_new(d, d->info, 1, &c);
    if (rc) {
        say(err, n, "opening a reliable datagram endpoint: %s", p_strerror(-rc));
        return rc;
    }
    (void)namelen;
    int got = fi_av_insert(c->av, name, 1, &c->peer, 0, NULL);
    if (got != 1) {
        rc = got < 0 ? got : -FI_EADDRNOTAVAIL;
        say(err, n, "the peer's address was not taken into the address vector: %s", p_strerror(-rc));
        pf_conn_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

/* 1 when the peer closed the connection (or it failed), 0 while it stands (always 0 for a
 * datagram endpoint: it has no connection to lose). */
int pf_conn_closed(pf_conn *c) {
    if (!c->eq) return 0;
    uint8_t buf[sizeof(struct fi_eq_cm_entry) + PF_CM_DATA_MAX];
    uint32_t event = 0;
    ssize_t got = fi_eq_read(c->eq, &event, buf, sizeof buf, 0);
    if (got == -FI_EAVAIL) {
        struct fi_eq_err_entry e = {0};
        fi_eq_readerr(c->eq, &e, 0);
        return 1;
    }
    if (got > 0 && event == FI_SHUTDOWN) return 1;
    return 0;
}

/* Registers [addr, addr + len). requested_key is the key asked for where the provider does not
 * choose keys itself (it ignores it under FI_MR_PROV_KEY); *key is the key in force. */
int pf_mr_reg(pf_domain *d, void *addr, size_t len, uint64_t access, uint64_t requested_key, struct fid_mr **out,
              uint64_t *key, void **desc) {
    *out = NULL;
    int rc = fi_mr_reg(d->domain, addr, len, access, 0, requested_key, 0, out, NULL);
    if (rc) return rc;
    *key = fi_mr_key(*out);
    *desc = fi_mr_desc(*out);
    return 0;
}

int pf_mr_close(struct fid_mr *mr) { return mr ? fi_close(&mr->fid) : 0; }

/* Posts one RDMA WRITE of [buf, buf + len) to the peer's [addr, addr + len) under key (the
 * connected peer, or the datagram endpoint's one), with delivery completion; ctx comes back with
 * its completion. -FI_EAGAIN: the queue is full (read
 * completions, then post again). */
int pf_write(pf_conn *c, const void *buf, size_t len, void *desc, uint64_t addr, uint64_t key, uint64_t ctx) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct fi_rma_iov rma = {.addr = addr, .len = len, .key = key};
    struct fi_msg_rma msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = c->peer == FI_ADDR_UNSPEC ? 0 : c->peer,
        .rma_iov = &rma,
        .rma_iov_count = 1,
        .context = (void *)(uintptr_t)ctx,
        .data = 0,
    };
    ssize_t rc = fi_writemsg(c->ep, &msg, FI_DELIVERY_COMPLETE | FI_COMPLETION);
    return (int)rc;
}

/* Reads up to max completions into ctxs, waiting up to timeout_ms for the first (0: not at all;
 * waiting also drives a software provider's progress). Returns how many; on a failed operation
 * returns its negative error with *failed_ctx set and a message in err. */
int pf_poll(pf_conn *c, int timeout_ms, uint64_t *ctxs, int max, uint64_t *failed_ctx, char *err, size_t n) {
    struct fi_cq_entry entries[64];
    if (max > 64) max = 64;
    ssize_t got = timeout_ms > 0 ? fi_cq_sread(c->cq, entries, (size_t)max, NULL, timeout_ms)
                                 : fi_cq_read(c->cq, entries, (size_t)max);
    if (got == -FI_EAGAIN || got == -FI_ETIMEDOUT) return 0;
    if (got == -FI_EAVAIL) {
        struct fi_cq_err_entry e = {0};
        fi_cq_readerr(c->cq, &e, 0);
        *failed_ctx = (uint64_t)(uintptr_t)e.op_context;
        say(err, n, "%s (provider error %d)", p_strerror(e.err), e.prov_errno);
        return e.err ? -e.err : -FI_EIO;
    }
    if (got < 0) {
        say(err, n, "reading completions: %s", p_strerror((int)-got));
        *failed_ctx = 0;
        return (int)got;
    }
    for (ssize_t i = 0; i < got; i++) ctxs[i] = (uint64_t)(uintptr_t)entries[i].op_context;
    return (int)got;
}
