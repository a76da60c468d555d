/* Collectives between processes of one host through a shared-memory segment
 * (kernels/shm_collectives.py maps the segment, builds this file and calls it through ctypes).
 *
 * Segment layout (the Python side creates it; offsets in bytes):
 *   [0, 64)                       header: magic, world, slot_bytes, abort word
 *   [64 * (1 + r), 64 * (2 + r))  rank r's line: arrival counter, pid, the step it posted
 *   [DATA_OFFSET, ...)            2 parities x world slots x slot_bytes
 *
 * Every collective is cut into pieces that fit a slot. A piece: each rank copies its part into
 * its own slot of the piece's parity, all ranks meet at a barrier, each reads what it needs
 * from every slot. Pieces alternate parity, so a slot is written again only two pieces later,
 * after a barrier every rank passed once it had finished reading it: one barrier per piece
 * (two for a large all-reduce, which reduces a chunk per rank, then gathers the chunks).
 * Sums run in a fixed rank order, in fp32 for 16-bit floats, so every rank gets the same bits.
 *
 * A barrier is each rank storing its arrival count (release) and loading the others' (acquire):
 * one writer per line, no read-modify-write; a waiter past a short spin sleeps on a shared
 * futex the arriving rank wakes. While it waits it checks that the ranks it waits for are
 * alive (kill(pid, 0)), the abort word, and the deadline, and returns which rank it waited for
 * when it gives up.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LINE 64
#define DATA_OFFSET 4096
#define MAGIC 0x6d6973686d763031ULL /* "mishmv01" */
#define MAX_WORLD 63                     /* LINE * (1 + world) <= DATA_OFFSET */

enum { MI_OK = 0, MI_TIMEOUT = 1, MI_DEAD = 2, MI_ABORTED = 3, MI_MISMATCH = 4, MI_BAD = 5 };
enum { MI_F32 = 0, MI_F64 = 1, MI_BF16 = 2, MI_F16 = 3, MI_I32 = 4, MI_I64 = 5 };

typedef struct {
    uint64_t arrived;   /* barriers this rank has reached */
    int64_t pid;
    uint64_t kind[2];   /* the collective this rank entered (kind x 8 + dtype) and its size, */
    uint64_t nbytes[2]; /* at [collectives % 2]: a rank one collective ahead writes the other pair */
} rank_line;

typedef struct {
    char *base;
    int rank, world;
    uint64_t slot_bytes;
    uint64_t barriers; /* this rank's count; the same sequence on every rank */
    uint64_t pieces;   /* parity = pieces % 2 */
    uint64_t collectives;
    double timeout_s;
    int missing;       /* the rank a failed barrier waited for, or the mismatching one */
} mi_comm;

static inline uint64_t *abort_word(mi_comm *c) { return (uint64_t *)(c->base + 24); }
static inline rank_line *line_of(mi_comm *c, int r) { return (rank_line *)(c->base + LINE * (1 + r)); }
static inline char *slot(mi_comm *c, uint64_t parity, int r) {
    return c->base + DATA_OFFSET + (parity * (uint64_t)c->world + (uint64_t)r) * c->slot_bytes;
}

uint64_t mi_segment_bytes(int world, uint64_t slot_bytes) {
    return DATA_OFFSET + 2ULL * (uint64_t)world * slot_bytes;
}

/* the creating rank writes the header; every rank its own line */
int mi_init_header(char *base, int world, uint64_t slot_bytes) {
    if (world < 1 || world > MAX_WORLD) return MI_BAD;
    uint64_t *h = (uint64_t *)base;
    h[1] = (uint64_t)world;
    h[2] = slot_bytes;
    __atomic_store_n(&h[3], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&h[0], MAGIC, __ATOMIC_RELEASE);
    return MI_OK;
}

mi_comm *mi_open(char *base, int rank, int world, uint64_t slot_bytes, double timeout_s) {
    uint64_t *h = (uint64_t *)base;
    if (__atomic_load_n(&h[0], __ATOMIC_ACQUIRE) != MAGIC || h[1] != (uint64_t)world || h[2] != slot_bytes)
        return NULL;
    if (rank < 0 || rank >= world) return NULL;
    mi_comm *c = calloc(1, sizeof(mi_comm));
    if (!c) return NULL;
    c->base = base;
    c->rank = rank;
    c->world = world;
    c->slot_bytes = slot_bytes;
    c->timeout_s = timeout_s;
    c->missing = -1;
    rank_line *me = line_of(c, rank);
    me->pid = (int64_t)getpid();
    __atomic_store_n(&me->arrived, 0, __ATOMIC_RELEASE);
    return c;
}

void mi_close(mi_comm *c) { free(c); }
int mi_missing(mi_comm *c) { return c->missing; }
int64_t mi_pid(mi_comm *c, int r) { return __atomic_load_n(&line_of(c, r)->pid, __ATOMIC_ACQUIRE); }

/* tell the peers this rank gave up (they stop waiting for it) */
void mi_abort(mi_comm *c) { __atomic_store_n(abort_word(c), (uint64_t)c->rank + 1, __ATOMIC_RELEASE); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
/* arrival counts are 64-bit; a futex watches their low 32 bits (little-endian: the first word) */
static inline uint32_t *low_word(uint64_t *p) { return (uint32_t *)p; }
static void wake_all(uint64_t *p) { syscall(SYS_futex, low_word(p), FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }
static void wait_while(uint64_t *p, uint64_t seen, long ns) {
    struct timespec t = {0, ns};
    syscall(SYS_futex, low_word(p), FUTEX_WAIT, (uint32_t)seen, &t, NULL, 0);
}
#else
static void wake_all(uint64_t *p) { (void)p; }
static void wait_while(uint64_t *p, uint64_t seen, long ns) {
    (void)p; (void)seen;
    struct timespec t = {0, ns < 50000 ? ns : 50000};
    nanosleep(&t, NULL);
}
#endif

/* how long a waiter spins before it sleeps */
double mi_spin_s = 100e-6;

/* Spin briefly (a peer on its own core arrives within microseconds), then sleep on the peer's
 * arrival word (a shared futex: the arriving rank wakes its waiters), waking every 2 ms to look
 * around: the abort word, the peer's pid, the deadline. No core is burnt while a peer computes. */
static int barrier(mi_comm *c) {
    uint64_t target = ++c->barriers;
    uint64_t *mine = &line_of(c, c->rank)->arrived;
    __atomic_store_n(mine, target, __ATOMIC_RELEASE);
    wake_all(mine);
    double deadline = 0.0;
    for (int r = 0; r < c->world; r++) {
        if (r == c->rank) continue;
        rank_line *l = line_of(c, r);
        unsigned long spins = 0;
        double spin_until = 0.0;
        uint64_t seen;
        while ((seen = __atomic_load_n(&l->arrived, __ATOMIC_ACQUIRE)) < target) {
            if (++spins % 256) { cpu_relax(); continue; }
            /* a sleeping rank takes tens of microseconds to wake on a VM: spin SPIN_S first */
            double t0 = now_s();
            if (spin_until == 0.0) spin_until = t0 + mi_spin_s;
            if (t0 < spin_until) continue;
            wait_while(&l->arrived, seen, 2000000);
            /* each verdict re-reads the arrival: a peer that arrived, then gave up or died,
             * did complete this barrier (its arrival was stored before) */
            uint64_t who = __atomic_load_n(abort_word(c), __ATOMIC_ACQUIRE);
            int dead = !who && kill((pid_t)l->pid, 0) != 0 && errno == ESRCH;
            double t = now_s();
            if (deadline == 0.0) deadline = t + c->timeout_s;
            int late = t > deadline;
            if ((who || dead || late) && __atomic_load_n(&l->arrived, __ATOMIC_ACQUIRE) < target) {
                if (who) { c->missing = (int)who - 1; return MI_ABORTED; }
                c->missing = r;
                return dead ? MI_DEAD : MI_TIMEOUT;
            }
        }
    }
    return MI_OK;
}

/* What a collective posts before its first barrier; after that barrier `check_posted` compares
 * every rank's. A rank can be at most one collective ahead of another there (each collective
 * has a barrier after its check), so two alternating pairs suffice. */
static void post(mi_comm *c, uint64_t kind, uint64_t nbytes) {
    rank_line *me = line_of(c, c->rank);
    me->kind[c->collectives % 2] = kind;
    me->nbytes[c->collectives % 2] = nbytes;
}

static int check_posted(mi_comm *c) {
    uint64_t i = c->collectives++ % 2;
    rank_line *me = line_of(c, c->rank);
    for (int r = 0; r < c->world; r++) {
        rank_line *l = line_of(c, r);
        if (l->kind[i] != me->kind[i] || l->nbytes[i] != me->nbytes[i]) { c->missing = r; return MI_MISMATCH; }
    }
    return MI_OK;
}

/* a piece's barrier; the collective's first also checks what the ranks posted */
static int meet(mi_comm *c, int first) {
    int rc = barrier(c);
    if (rc || !first) return rc;
    return check_posted(c);
}

/* what rank r posted for this rank's last collective: 0 its kind x 8 + dtype, 1 its bytes */
uint64_t mi_posted(mi_comm *c, int r, int what) {
    uint64_t i = (c->collectives + 1) % 2;
    return what ? line_of(c, r)->nbytes[i] : line_of(c, r)->kind[i];
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* out[i] = sum over ranks r (in rank order) of src[r][i], n elements, also stored to `out2`
 * when given. Block by block through a local accumulator, so an output may alias a source. A
 * rank's own part is read from its input where it has it: only the peers' parts go through the
 * segment. */
#define BLOCK 1024
#define SUM_DIRECT(T)                                                                   \
    {                                                                                   \
        T acc[BLOCK];                                                                   \
        for (size_t b = 0; b < n; b += BLOCK) {                                         \
            size_t m = n - b < BLOCK ? n - b : BLOCK;                                   \
            const T *s0 = (const T *)src[0] + b;                                        \
            for (size_t i = 0; i < m; i++) acc[i] = s0[i];                             \
            for (int r = 1; r < world; r++) {                                          \
                const T *s = (const T *)src[r] + b;                                     \
                for (size_t i = 0; i < m; i++) acc[i] += s[i];                         \
            }                                                                           \
            memcpy((T *)out + b, acc, m * sizeof(T));                                   \
            if (out2) memcpy((T *)out2 + b, acc, m * sizeof(T));                        \
        }                                                                               \
    }

static void sum_sources(const char **src, int world, void *out, void *out2, size_t n, int dtype) {
    switch (dtype) {
    case MI_F32: SUM_DIRECT(float) break;
    case MI_F64: SUM_DIRECT(double) break;
    case MI_I32: SUM_DIRECT(int32_t) break;
    case MI_I64: SUM_DIRECT(int64_t) break;
    case MI_BF16:
    case MI_F16: {
        float acc[BLOCK];
        uint16_t half[BLOCK];
        for (size_t b = 0; b < n; b += BLOCK) {
            size_t m = n - b < BLOCK ? n - b : BLOCK;
            for (int r = 0; r < world; r++) {
                const uint16_t *s = (const uint16_t *)src[r] + b;
                if (dtype == MI_BF16) {
                    if (r == 0) for (size_t i = 0; i < m; i++) acc[i] = bf16_to_f32(s[i]);
                    else for (size_t i = 0; i < m; i++) acc[i] += bf16_to_f32(s[i]);
                } else {
                    const _Float16 *h = (const _Float16 *)s;
                    if (r == 0) for (size_t i = 0; i < m; i++) acc[i] = (float)h[i];
                    else for (size_t i = 0; i < m; i++) acc[i] += (float)h[i];
                }
            }
            if (dtype == MI_BF16) {
                for (size_t i = 0; i < m; i++) half[i] = f32_to_bf16(acc[i]);
            } else {
                _Float16 *h = (_Float16 *)half;
                for (size_t i = 0; i < m; i++) h[i] = (_Float16)acc[i];
            }
            memcpy((uint16_t *)out + b, half, m * 2);
            if (out2) memcpy((uint16_t *)out2 + b, half, m * 2);
        }
        break;
    }
    }
}

/* the sources of a sum over element range starting at byte `offset` of every slot; this
 * rank's own from `mine` instead */
static void slot_sources(mi_comm *c, uint64_t parity, uint64_t offset, const char *mine, const char **src) {
    for (int r = 0; r < c->world; r++) src[r] = r == c->rank ? mine : slot(c, parity, r) + offset;
}

static size_t elem_size(int dtype) {
    switch (dtype) {
    case MI_F32: case MI_I32: return 4;
    case MI_F64: case MI_I64: return 8;
    case MI_BF16: case MI_F16: return 2;
    }
    return 0;
}

enum { K_ALL_REDUCE = 1, K_ALL_GATHER = 2, K_REDUCE_SCATTER = 3, K_BROADCAST = 4 };

/* all-reduce pieces up to this size: every rank sums every slot (one barrier); larger: a chunk
 * per rank, then the chunks gathered (two barriers, each rank reading 2/world of the data) */
uint64_t mi_one_shot_max = 64 * 1024;

int mi_all_reduce(mi_comm *c, const char *in, char *out, uint64_t nbytes, int dtype) {
    size_t es = elem_size(dtype);
    if (!es || nbytes % es) return MI_BAD;
    int rc;
    const char *src[MAX_WORLD];
    post(c, K_ALL_REDUCE * 8 + dtype, nbytes);
    if (nbytes == 0) return meet(c, 1);
    /* a piece is a whole number of elements, and its per-rank chunks too */
    uint64_t piece = c->slot_bytes - c->slot_bytes % (es * c->world);
    for (uint64_t off = 0; off < nbytes; off += piece) {
        uint64_t len = nbytes - off < piece ? nbytes - off : piece;
        uint64_t parity = c->pieces++ % 2;
        if (len <= mi_one_shot_max || c->world == 1) {
            memcpy(slot(c, parity, c->rank), in + off, len);
            if ((rc = meet(c, off == 0))) return rc;
            slot_sources(c, parity, 0, in + off, src);
            sum_sources(src, c->world, out + off, NULL, len / es, dtype);
            continue;
        }
        /* rank r sums chunk r: the others' chunks go into this rank's slot, its own stays put */
        uint64_t elems = len / es, per = (elems + c->world - 1) / c->world;
#define LO(r) ((uint64_t)(r) * per < elems ? (uint64_t)(r) * per : elems)
#define HI(r) (LO(r) + per < elems ? LO(r) + per : elems)
        for (int r = 0; r < c->world; r++)
            if (r != c->rank && HI(r) > LO(r))
                memcpy(slot(c, parity, c->rank) + LO(r) * es, in + off + LO(r) * es, (HI(r) - LO(r)) * es);
        if ((rc = meet(c, off == 0))) return rc;
        uint64_t lo = LO(c->rank), hi = HI(c->rank);
        if (hi > lo) {
            slot_sources(c, parity, lo * es, in + off + lo * es, src);
            /* the sum to this rank's output, and to its slot for the others */
            sum_sources(src, c->world, out + off + lo * es, slot(c, parity, c->rank) + lo * es, hi - lo, dtype);
        }
        if ((rc = barrier(c))) return rc;
        for (int r = 0; r < c->world; r++)
            if (r != c->rank && HI(r) > LO(r))
                memcpy(out + off + LO(r) * es, slot(c, parity, r) + LO(r) * es, (HI(r) - LO(r)) * es);
#undef LO
#undef HI
    }
    return MI_OK;
}

/* out (world x nbytes) = every rank's in (nbytes), in rank order */
int mi_all_gather(mi_comm *c, const char *in, char *out, uint64_t nbytes) {
    int rc;
    post(c, K_ALL_GATHER * 8, nbytes);
    if (nbytes == 0) return meet(c, 1);
    for (uint64_t off = 0; off < nbytes; off += c->slot_bytes) {
        uint64_t len = nbytes - off < c->slot_bytes ? nbytes - off : c->slot_bytes;
        uint64_t parity = c->pieces++ % 2;
        memcpy(slot(c, parity, c->rank), in + off, len);
        if ((rc = meet(c, off == 0))) return rc;
        for (int r = 0; r < c->world; r++)
            memcpy(out + (uint64_t)r * nbytes + off, r == c->rank ? in + off : slot(c, parity, r), len);
    }
    return MI_OK;
}

/* out (out_bytes) = the sum over ranks of their in's chunk `rank` (in is world x out_bytes) */
int mi_reduce_scatter(mi_comm *c, const char *in, char *out, uint64_t out_bytes, int dtype) {
    size_t es = elem_size(dtype);
    if (!es || out_bytes % es) return MI_BAD;
    uint64_t piece = c->slot_bytes / c->world;
    piece -= piece % es;
    if (piece == 0) return MI_BAD;
    int rc;
    const char *src[MAX_WORLD];
    post(c, K_REDUCE_SCATTER * 8 + dtype, out_bytes);
    if (out_bytes == 0) return meet(c, 1);
    for (uint64_t off = 0; off < out_bytes; off += piece) {
        uint64_t len = out_bytes - off < piece ? out_bytes - off : piece;
        uint64_t parity = c->pieces++ % 2;
        for (int r = 0; r < c->world; r++)  /* the others' chunks; this rank's own stays in its input */
            if (r != c->rank)
                memcpy(slot(c, parity, c->rank) + (uint64_t)r * len, in + (uint64_t)r * out_bytes + off, len);
        if ((rc = meet(c, off == 0))) return rc;
        slot_sources(c, parity, (uint64_t)c->rank * len, in + (uint64_t)c->rank * out_bytes + off, src);
        sum_sources(src, c->world, out + off, NULL, len / es, dtype);
    }
    return MI_OK;
}

/* buf (nbytes) = root's buf on every rank: the root copies each piece into its slot, every rank
 * meets, the others read that slot (the serving engine's per-step messages from its driver) */
int mi_broadcast(mi_comm *c, char *buf, uint64_t nbytes, int root) {
    if (root < 0 || root >= c->world) return MI_BAD;
    int rc;
    post(c, K_BROADCAST * 8 + ((uint64_t)(root + 1) << 32), nbytes); /* the root in the high word */
    if (nbytes == 0) return meet(c, 1);
    for (uint64_t off = 0; off < nbytes; off += c->slot_bytes) {
        uint64_t len = nbytes - off < c->slot_bytes ? nbytes - off : c->slot_bytes;
        uint64_t parity = c->pieces++ % 2;
        if (c->rank == root) memcpy(slot(c, parity, root), buf + off, len);
        if ((rc = meet(c, off == 0))) return rc;
        if (c->rank != root) memcpy(buf + off, slot(c, parity, root), len);
    }
    return MI_OK;
}

/* a barrier alone (attach's check that every rank mapped the segment, and tests) */
int mi_barrier(mi_comm *c) { return barrier(c); }
