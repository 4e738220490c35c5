/* gmlx's small-M sgemm for MLX's CPU backend (gmlx/small_gemm.py builds and loads it).

Why: a decode step multiplies 1 to a few rows by every weight matrix. MLX's CPU matmul calls
cblas_sgemm, and OpenBLAS's gemm packs the weight matrix before multiplying - at 1-4 rows that
copy costs as much as the product, so a float32 step read its weights at ~13 GB/s on a 2-core
EPYC where a plain pass reads them at ~30 GB/s, and a verify of 2 / 4 tokens cost 1.15 / 1.35
steps (docs/cpu_kernel.md has the measurements). This kernel streams each weight row once and
multiplies it by up to 4 activation rows held in cache (4 x 4 register blocks), so 1-4 rows cost
about one pass over the weights: plain steps get faster and a verify is nearly free.

It interposes cblas_sgemm (loaded RTLD_GLOBAL before OpenBLAS): row-major C = alpha A B^T + beta C
with A's rows <= the row limit runs here; every other call goes to OpenBLAS unchanged.

Numerics: each output is one dot product summed in the same order (LANES-wide partial sums over
k, then the lanes in order, then the k tail) whatever M, the block or the thread computing it,
so a row's logits are bit-identical whether it is decoded alone or verified with drafts. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112,
       MR = 4,      /* activation rows per block, in registers */
       SLAB = 32,   /* weight rows per slab: what one thread takes at a time, kept in L2 */
       AHEAD = 1536, /* floats: how far ahead of the weight being multiplied its stream is prefetched */
       SPIN = 2000, /* a waiting thread's pauses (~20-60 us), then YIELDS sched_yield()s, then (workers) sleep */
       YIELDS = 200, MAX_THREADS = 16,
       PARALLEL_MIN = 1 << 16 /* N x K below this: one thread (waking another costs more) */ };

static sgemm_fn blas_sgemm;
static int row_limit;
static atomic_long small_calls, blas_calls;

struct job { int M, N, K; float alpha, beta; const float *A; int lda; const float *B; int ldb; float *C; int ldc; };

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

static inline float finish(vf acc, const float *a, const float *b, int k0, int K) {
  float s = 0.0f;
  for (int i = 0; i < LANES; i++) s += acc[i];
  for (int k = k0; k < K; k++) s += a[k] * b[k];
  return s;
}

static inline void store(const struct job *j, int m, int n, float s) {
  float *c = j->C + (size_t)m * j->ldc + n;
  *c = j->beta == 0.0f ? j->alpha * s : j->alpha * s + j->beta * *c;  /* beta 0: C is not read (may be NaN) */
}

/* C[m0:m0+mr, n]: mr dot products over k with weight row n, read once for the block (more weight
   rows per block measured slower: docs/cpu_kernel.md). */
static inline __attribute__((always_inline)) void block(const struct job *j, int m0, int n, int mr) {
  vf acc[MR];
  const float *a[MR], *b = j->B + (size_t)n * j->ldb;
  for (int m = 0; m < mr; m++) {
    a[m] = j->A + (size_t)(m0 + m) * j->lda;
    acc[m] = (vf){0};
  }
  int kv = j->K - j->K % LANES;
  for (int k = 0; k < kv; k += LANES) {
    vf bv = load(b + k);
    /* The weights stream from memory (their slab is in L2 only for the next block of rows): without
       this, 2 / 4 rows took 1.3 / 1.6x one row's time on an Intel Xeon, and the hardware's prefetch
       did not keep up (docs/cpu_kernel.md, "Prefetching the weights"). A prefetch past the end of B
       never faults (a hint, x86 and arm64 alike). */
    __builtin_prefetch(b + k + AHEAD, 0, 3);
    for (int m = 0; m < mr; m++) acc[m] += load(a[m] + k) * bv;
  }
  for (int m = 0; m < mr; m++) store(j, m0 + m, n, finish(acc[m], a[m], b, kv, j->K));
}

/* Constant block heights, so that each is unrolled into registers. */
#define ROWS(mr)                                                                           \
  static void rows##mr(const struct job *j, int m0, int n0, int n1) {                      \
    for (int n = n0; n < n1; n++) block(j, m0, n, mr);                                     \
  }
ROWS(1) ROWS(2) ROWS(3) ROWS(4)

/* Weight rows in slabs of SLAB (kept in L2 while every block of MR activation rows passes over
   them: the weights stream from memory once whatever M). */
static void columns(const struct job *j, int n0, int n1) {
  for (int s0 = n0; s0 < n1; s0 += SLAB) {
    int s1 = s0 + SLAB < n1 ? s0 + SLAB : n1;
    for (int m0 = 0; m0 < j->M; m0 += MR) {
      int mr = j->M - m0 < MR ? j->M - m0 : MR;
      if (mr == 4) rows4(j, m0, s0, s1);
      else if (mr == 3) rows3(j, m0, s0, s1);
      else if (mr == 2) rows2(j, m0, s0, s1);
      else rows1(j, m0, s0, s1);
    }
  }
}

/* A pool of nthreads - 1 workers beside the caller. A job's columns are cut into slabs that
   whoever is running takes in turn (an atomic counter): a worker the OS has not scheduled yet (a
   shared or busy machine, several processes) delays nothing, the caller takes its slabs, and
   waits only for slabs being computed. Workers spin briefly after a job (the next matmul of a
   step comes within microseconds), yield the CPU for a while, then sleep. */
static int nthreads, started;
static long born;  /* the generation when the workers started (the first job is the next) */
static struct job current;
static atomic_long generation;
static atomic_int next_slab, done_slabs, slabs, active, sleepers, busy;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static void take_slabs(const struct job *j) {
  int total = atomic_load(&slabs), s;
  while ((s = atomic_fetch_add(&next_slab, 1)) < total) {
    int n0 = s * SLAB, n1 = n0 + SLAB < j->N ? n0 + SLAB : j->N;
    columns(j, n0, n1);
    atomic_fetch_add(&done_slabs, 1);
  }
}

/* Wait for `ready()`: spin, then yield the CPU (others may need it more), then (workers) sleep. */
static int waited(int spins) {
  if (spins < SPIN) RELAX();
  else sched_yield();
  return spins + 1;
}

/* Generations: odd while the caller writes a job (closed), even once it is published (open). */
static inline int open_job(long g, long seen) { return g != seen && (g & 1) == 0; }

static void *worker(void *arg) {
  (void)arg;
  long seen = born;
  for (;;) {
    long g;
    for (int spins = 0; !open_job(g = atomic_load(&generation), seen);) {
      if (spins < SPIN + YIELDS) {
        spins = waited(spins);
        continue;
      }
      pthread_mutex_lock(&lock);
      atomic_fetch_add(&sleepers, 1);
      while (!open_job(g = atomic_load(&generation), seen)) pthread_cond_wait(&wake, &lock);
      atomic_fetch_sub(&sleepers, 1);
      pthread_mutex_unlock(&lock);
      break;
    }
    /* Counted in before reading the job: the caller closes the generation, then waits for no worker
       inside, then writes - a worker that counts itself in after the close sees it closed. */
    atomic_fetch_add(&active, 1);
    if (atomic_load(&generation) == g) take_slabs(&current);
    atomic_fetch_sub(&active, 1);
    seen = g;
  }
  return 0;
}

static void after_fork_child(void) {  /* the workers are not in the child: start them again on first use */
  started = 0;
  atomic_store(&busy, 0);
  atomic_store(&sleepers, 0);
  atomic_store(&active, 0);
  if (atomic_load(&generation) & 1) atomic_fetch_add(&generation, 1);  /* forked while a job was written */
  pthread_mutex_init(&lock, 0);
  pthread_cond_init(&wake, 0);
}

static void start(void) {
  if (started) return;
  started = 1;
  born = atomic_load(&generation);
  for (int t = 1; t < nthreads; t++) {
    pthread_t id;
    if (pthread_create(&id, 0, worker, 0) != 0) { nthreads = t; break; }
    pthread_detach(id);
  }
}

static void run(const struct job *j) {
  int expected = 0;
  /* one job at a time in the pool; a second caller (another thread) computes alone */
  if (nthreads < 2 || (long)j->N * j->K < PARALLEL_MIN || !atomic_compare_exchange_strong(&busy, &expected, 1)) {
    columns(j, 0, j->N);
    return;
  }
  start();
  atomic_fetch_add(&generation, 1);  /* closed (odd): a worker waking late takes nothing of the last job... */
  for (int spins = 0; atomic_load(&active) > 0;) spins = waited(spins);  /* ... and one inside it leaves */
  current = *j;
  atomic_store(&slabs, (j->N + SLAB - 1) / SLAB);
  atomic_store(&next_slab, 0);
  atomic_store(&done_slabs, 0);
  atomic_fetch_add(&generation, 1);  /* open (even) */
  if (atomic_load(&sleepers) > 0) {
    pthread_mutex_lock(&lock);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
  }
  take_slabs(j);
  for (int spins = 0, total = atomic_load(&slabs); atomic_load(&done_slabs) < total;) spins = waited(spins);
  atomic_store(&busy, 0);
}

/* The interposed entry point (the CBLAS signature; enums as ints). */
void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
  if (order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && M >= 1 && M <= row_limit && N >= 1 && K >= 1) {
    atomic_fetch_add_explicit(&small_calls, 1, memory_order_relaxed);
    struct job j = {M, N, K, alpha, beta, A, lda, B, ldb, C, ldc};
    run(&j);
    return;
  }
  atomic_fetch_add_explicit(&blas_calls, 1, memory_order_relaxed);
  blas_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* blas: a dlopen handle of the BLAS that computes every other call; rows: the row limit (0: none
   here); threads: the pool's size including the caller (0: the CPUs this process may use). */
int gmlx_small_gemm_init(void *blas, int rows, int threads) {
  blas_sgemm = (sgemm_fn)dlsym(blas, "cblas_sgemm");
  if (!blas_sgemm) return -1;
  if (threads <= 0) {
    cpu_set_t set;
    threads = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  }
  nthreads = threads > MAX_THREADS ? MAX_THREADS : threads;
  row_limit = rows;
  static int once;
  if (!once++) pthread_atfork(0, 0, after_fork_child);
  return nthreads;
}

void gmlx_small_gemm_counts(long *small, long *blas) {
  *small = atomic_load(&small_calls);
  *blas = atomic_load(&blas_calls);
}
