/* Probe: does libfabric's software tcp provider take CUDA device memory (FI_HMEM_CUDA) for
 * one-sided writes, in a verbs NIC's registration modes? Host->device and device->device
 * RDMA WRITE of 8 MiB over a connected endpoint on 127.0.0.1, checked byte for byte. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#define CK(x) do { int _r = (x); if (_r) { printf("FAIL %s = %d %s\n", #x, _r, fi_strerror(-_r)); exit(1); } } while (0)
typedef int (*cu_fn)();
static cu_fn cuInit_, cuDeviceGet_, cuCtxCreate_, cuMemAlloc_, cuMemcpyHtoD_, cuMemcpyDtoH_, cuCtxSetCurrent_;
static void *ctx;
static uint64_t want = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM;
static struct fi_info *gi(uint64_t flags, const char *svc) {
  struct fi_info *h = fi_allocinfo(), *info;
  h->ep_attr->type = FI_EP_MSG; h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_HMEM;
  h->domain_attr->mr_mode = want; h->domain_attr->threading = FI_THREAD_SAFE;
  h->tx_attr->op_flags = FI_DELIVERY_COMPLETE; h->fabric_attr->prov_name = strdup("tcp");
  int r = fi_getinfo(FI_VERSION(1, 17), "127.0.0.1", svc, flags, h, &info);
  if (r) { printf("RESULT getinfo with FI_HMEM refused: %d %s\n", r, fi_strerror(-r)); exit(2); }
  printf("provider %s domain %s mr_mode=%s caps has HMEM=%d\n", info->fabric_attr->prov_name, info->domain_attr->name,
         fi_tostr(&info->domain_attr->mr_mode, FI_TYPE_MR_MODE), !!(info->caps & FI_HMEM));
  info->domain_attr->mr_mode |= want;
  return info;
}
struct { struct fid_eq *eq; struct fid_domain *d; struct fid_cq *cq; } D;
static void *acc(void *a) {
  uint32_t ev; uint8_t buf[sizeof(struct fi_eq_cm_entry) + 256]; struct fi_eq_cm_entry *ent = (void *)buf;
  fi_eq_sread(D.eq, &ev, buf, sizeof buf, 5000, 0);
  ent->info->domain_attr->mr_mode |= want;
  struct fid_ep *ep; CK(fi_endpoint(D.d, ent->info, &ep, NULL)); CK(fi_ep_bind(ep, &D.eq->fid, 0));
  CK(fi_ep_bind(ep, &D.cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(ep)); CK(fi_accept(ep, NULL, 0));
  fi_eq_sread(D.eq, &ev, buf, sizeof buf, 5000, 0); return 0;
}
static volatile int stop;
static void *prog(void *a) { struct fi_cq_entry c; cuCtxSetCurrent_(ctx); while (!stop) { fi_cq_read(D.cq, &c, 0); usleep(50); } return 0; }
static struct fid_mr *reg(struct fid_domain *d, void *p, size_t n, uint64_t acc, int cuda) {
  struct iovec iov = {p, n}; struct fi_mr_attr a = {0};
  a.mr_iov = &iov; a.iov_count = 1; a.access = acc; a.iface = cuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM; a.device.cuda = 0;
  struct fid_mr *mr; int r = fi_mr_regattr(d, &a, 0, &mr);
  if (r) { printf("RESULT registering %s memory refused: %d %s\n", cuda ? "CUDA" : "host", r, fi_strerror(-r)); exit(3); }
  return mr;
}
static int wr(struct fid_ep *ep, struct fid_cq *cq, void *buf, size_t len, void *desc, uint64_t addr, uint64_t key) {
  struct iovec iov = {buf, len}; struct fi_rma_iov rma = {addr, len, key};
  struct fi_msg_rma m = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .rma_iov = &rma, .rma_iov_count = 1};
  ssize_t r; while ((r = fi_writemsg(ep, &m, FI_DELIVERY_COMPLETE | FI_COMPLETION)) == -FI_EAGAIN) { struct fi_cq_entry c; fi_cq_read(cq, &c, 0); }
  if (r) return (int)r;
  struct fi_cq_entry c;
  for (int i = 0; i < 20000000; i++) { ssize_t n = fi_cq_read(cq, &c, 1); if (n == 1) return 0;
    if (n == -FI_EAVAIL) { struct fi_cq_err_entry e = {0}; fi_cq_readerr(cq, &e, 0); printf("completion error %s\n", fi_strerror(e.err)); return -e.err; } }
  return -FI_ETIMEDOUT;
}
int main(void) {
  void *cu = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cu) { printf("RESULT no libcuda: %s\n", dlerror()); return 4; }
  cuInit_ = dlsym(cu, "cuInit"); cuDeviceGet_ = dlsym(cu, "cuDeviceGet"); cuCtxCreate_ = dlsym(cu, "cuCtxCreate_v2");
  cuMemAlloc_ = dlsym(cu, "cuMemAlloc_v2"); cuMemcpyHtoD_ = dlsym(cu, "cuMemcpyHtoD_v2"); cuMemcpyDtoH_ = dlsym(cu, "cuMemcpyDtoH_v2");
  cuCtxSetCurrent_ = dlsym(cu, "cuCtxSetCurrent");
  int dev; if (cuInit_(0) || cuDeviceGet_(&dev, 0) || cuCtxCreate_(&ctx, 0, dev)) { printf("RESULT no CUDA device\n"); return 4; }
  const size_t N = 8 << 20;
  uint64_t d_dst, d_src; cuMemAlloc_(&d_dst, N); cuMemAlloc_(&d_src, N);
  char *host = malloc(N), *back = malloc(N);
  for (size_t i = 0; i < N; i++) host[i] = (char)(i * 7 + 3);
  cuMemcpyHtoD_(d_src, host, N);
  memset(back, 0, N); cuMemcpyHtoD_(d_dst, back, N);
  struct fi_info *di = gi(FI_SOURCE, "0");
  struct fid_fabric *df; CK(fi_fabric(di->fabric_attr, &df, NULL));
  struct fi_eq_attr ea = {.wait_obj = FI_WAIT_UNSPEC}; CK(fi_eq_open(df, &ea, &D.eq, NULL));
  CK(fi_domain(df, di, &D.d, NULL));
  struct fid_pep *pep; CK(fi_passive_ep(df, di, &pep, NULL)); CK(fi_pep_bind(pep, &D.eq->fid, 0)); CK(fi_listen(pep));
  char name[128]; size_t nl = sizeof name; CK(fi_getname(&pep->fid, name, &nl));
  struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_NONE}; CK(fi_cq_open(D.d, &ca, &D.cq, NULL));
  struct fi_info *pi = gi(FI_SOURCE, NULL);
  struct fid_fabric *pf; CK(fi_fabric(pi->fabric_attr, &pf, NULL));
  struct fid_eq *peq; CK(fi_eq_open(pf, &ea, &peq, NULL));
  struct fid_domain *pd; CK(fi_domain(pf, pi, &pd, NULL));
  struct fid_cq *pcq; CK(fi_cq_open(pd, &ca, &pcq, NULL));
  struct fid_ep *ep; CK(fi_endpoint(pd, pi, &ep, NULL)); CK(fi_ep_bind(ep, &peq->fid, 0)); CK(fi_ep_bind(ep, &pcq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(ep));
  pthread_t at; pthread_create(&at, 0, acc, 0);
  CK(fi_connect(ep, name, NULL, 0));
  uint32_t ev; uint8_t buf[256]; fi_eq_sread(peq, &ev, buf, sizeof buf, 5000, 0); pthread_join(at, 0);
  printf("connected (event %u)\n", ev);
  struct fid_mr *m_dst = reg(D.d, (void *)d_dst, N, FI_REMOTE_WRITE, 1);
  printf("registered D's CUDA region: key %lu\n", (unsigned long)fi_mr_key(m_dst));
  pthread_t pt; pthread_create(&pt, 0, prog, 0);
  struct fid_mr *m_host = reg(pd, host, N, FI_WRITE, 0);
  int r = wr(ep, pcq, host, N, fi_mr_desc(m_host), d_dst, fi_mr_key(m_dst));
  cuMemcpyDtoH_(back, d_dst, N);
  printf("RESULT host->CUDA write: rc %d, bytes equal: %d\n", r, memcmp(host, back, N) == 0);
  memset(back, 0, N); cuMemcpyHtoD_(d_dst, back, N);
  struct fid_mr *m_src = reg(pd, (void *)d_src, N, FI_WRITE, 1);
  r = wr(ep, pcq, (void *)d_src, N, fi_mr_desc(m_src), d_dst, fi_mr_key(m_dst));
  cuMemcpyDtoH_(back, d_dst, N);
  printf("RESULT CUDA->CUDA write: rc %d, bytes equal: %d\n", r, memcmp(host, back, N) == 0);
  stop = 1; pthread_join(pt, 0);
  return 0;
}
