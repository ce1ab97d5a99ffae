/* kselect's pthreadpool shim for XNNPack: sees, and per operator changes, the column tile of
 * XNNPack's parallel GEMM / IGEMM loops.
 *
 * Loaded with RTLD_GLOBAL before libpthreadpool and libXNNPACK, so the dynamic linker binds
 * XNNPack's PLT calls of pthreadpool_parallelize_{2..6}d_tile_2d to these functions; each one
 * records the call (for kselect to read back) and forwards to the real libpthreadpool function,
 * with the last tile replaced when a rule for this very call is registered.
 *
 * A rule matches a call only when the context pointer (XNNPack passes &op->context, stable per
 * operator), the task function, the last range, the second-last tile (the micro-kernel's mr) and
 * the tile XNNPack itself computed all equal what was recorded when the rule was made, so a rule
 * never applies to another operator or to a re-setup with other shapes. kselect only registers
 * tiles that are multiples of the operator's nr (the packed-weight block), which keeps every
 * column tile aligned with the packed weights.
 *
 * Built by kselect on first use: gcc -O3 -shared -fPIC tileshim.c -o tileshim.so -ldl
 * No code from XNNPack or pthreadpool is copied here; only the public pthreadpool.h signatures.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KSELECT_SHIM_VERSION 1
#define MAX_RULES 4096

typedef void* pool_t;
typedef void (*task_t)(void);

struct rule {
    const void* context;
    task_t task;
    size_t range_last;
    size_t tile_prev;
    size_t tile_default;
    size_t tile_new;
    int swap; /* run the last two tiled dimensions in the other order (columns outer) */
};

static struct rule rules[MAX_RULES];
static int nrules = 0;

/* The last call seen: dims, task, context, ranges and tiles (for kselect to read back). */
static struct {
    int dims;
    task_t task;
    const void* context;
    size_t range[6];
    size_t tile[2];
    size_t tile_used;
} last;

static unsigned long long calls = 0, overridden = 0;

/* Flags added to every parallel call (e.g. PTHREADPOOL_FLAG_YIELD_WORKERS: workers sleep in the
 * kernel after each operation instead of spinning). Set by kselect per inference / candidate. */
static uint32_t extra_flags = 0;

void kselect_shim_set_flags(uint32_t flags) { extra_flags = flags; }

uint32_t kselect_shim_flags(void) { return extra_flags; }

static void* real_lib = NULL;

static void* real(const char* name) {
    if (real_lib == NULL) {
        real_lib = dlopen("libpthreadpool.so.0", RTLD_NOW | RTLD_GLOBAL);
        if (real_lib == NULL) return NULL;
    }
    return dlsym(real_lib, name);
}

static size_t pick_tile(int dims, task_t task, const void* context, const size_t* range, size_t tile_prev,
                        size_t tile_last, int* swap) {
    *swap = 0;
    calls++;
    last.dims = dims;
    last.task = task;
    last.context = context;
    memset(last.range, 0, sizeof(last.range));
    memcpy(last.range, range, sizeof(size_t) * (size_t) dims);
    last.tile[0] = tile_prev;
    last.tile[1] = tile_last;
    size_t use = tile_last;
    for (int i = 0; i < nrules; i++) {
        const struct rule* r = &rules[i];
        if (r->context == context && r->task == task && r->range_last == range[dims - 1] && r->tile_prev == tile_prev &&
            r->tile_default == tile_last) {
            use = r->tile_new;
            *swap = r->swap;
            overridden++;
            break;
        }
    }
    last.tile_used = use;
    return use;
}

/* -- kselect's side -------------------------------------------------------------------- */
int kselect_shim_version(void) { return KSELECT_SHIM_VERSION; }

unsigned long long kselect_shim_calls(void) { return calls; }

unsigned long long kselect_shim_overridden(void) { return overridden; }

/* out[0] = dims, out[1] = task, out[2] = context, out[3..8] = ranges, out[9..10] = tiles, out[11] = tile used */
void kselect_shim_last(uint64_t* out) {
    out[0] = (uint64_t) last.dims;
    out[1] = (uint64_t) (uintptr_t) last.task;
    out[2] = (uint64_t) (uintptr_t) last.context;
    for (int i = 0; i < 6; i++) out[3 + i] = last.range[i];
    out[9] = last.tile[0];
    out[10] = last.tile[1];
    out[11] = last.tile_used;
}

void kselect_shim_reset_last(void) { memset(&last, 0, sizeof(last)); }

/* Registers (or replaces) the rule for this context; returns 0, or -1 when the table is full. */
int kselect_shim_set(const void* context, const void* task, size_t range_last, size_t tile_prev, size_t tile_default,
                     size_t tile_new, int swap) {
    const struct rule r = {context, (task_t) task, range_last, tile_prev, tile_default, tile_new, swap};
    for (int i = 0; i < nrules; i++) {
        if (rules[i].context == context) {
            rules[i] = r;
            return 0;
        }
    }
    if (nrules == MAX_RULES) return -1;
    rules[nrules++] = r;
    return 0;
}

void kselect_shim_remove(const void* context) {
    for (int i = 0; i < nrules; i++) {
        if (rules[i].context == context) {
            rules[i] = rules[--nrules];
            return;
        }
    }
}

void kselect_shim_clear(void) { nrules = 0; }

int kselect_shim_rules(void) { return nrules; }

/* -- the interposed pthreadpool functions ---------------------------------------------- */
/* Swapped order: the real pool iterates the last two tiled dimensions exchanged, and a wrapper
 * hands each tile back to XNNPack's task in its own argument order. Tiles are independent
 * (each writes its own block of the output), so only the order in which they run changes. */
struct swapped {
    task_t task;
    void* context;
};

typedef void (*task_2d_tile_2d_t)(void*, size_t, size_t, size_t, size_t);
typedef void (*task_3d_tile_2d_t)(void*, size_t, size_t, size_t, size_t, size_t);
typedef void (*task_4d_tile_2d_t)(void*, size_t, size_t, size_t, size_t, size_t, size_t);

static void swapped_2d(void* arg, size_t j, size_t i, size_t tile_j, size_t tile_i) {
    const struct swapped* s = arg;
    ((task_2d_tile_2d_t) s->task)(s->context, i, j, tile_i, tile_j);
}

static void swapped_3d(void* arg, size_t i, size_t k, size_t j, size_t tile_k, size_t tile_j) {
    const struct swapped* s = arg;
    ((task_3d_tile_2d_t) s->task)(s->context, i, j, k, tile_j, tile_k);
}

static void swapped_4d(void* arg, size_t i, size_t j, size_t l, size_t k, size_t tile_l, size_t tile_k) {
    const struct swapped* s = arg;
    ((task_4d_tile_2d_t) s->task)(s->context, i, j, k, l, tile_k, tile_l);
}

void pthreadpool_parallelize_2d_tile_2d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                        size_t tile_i, size_t tile_j, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_2d_tile_2d");
    flags |= extra_flags;
    const size_t range[2] = {range_i, range_j};
    int swap;
    tile_j = pick_tile(2, function, context, range, tile_i, tile_j, &swap);
    if (swap) {
        struct swapped s = {function, context};
        fn(pool, (task_t) swapped_2d, &s, range_j, range_i, tile_j, tile_i, flags);
    } else {
        fn(pool, function, context, range_i, range_j, tile_i, tile_j, flags);
    }
}

void pthreadpool_parallelize_3d_tile_2d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                        size_t range_k, size_t tile_j, size_t tile_k, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_3d_tile_2d");
    flags |= extra_flags;
    const size_t range[3] = {range_i, range_j, range_k};
    int swap;
    tile_k = pick_tile(3, function, context, range, tile_j, tile_k, &swap);
    if (swap) {
        struct swapped s = {function, context};
        fn(pool, (task_t) swapped_3d, &s, range_i, range_k, range_j, tile_k, tile_j, flags);
    } else {
        fn(pool, function, context, range_i, range_j, range_k, tile_j, tile_k, flags);
    }
}

void pthreadpool_parallelize_4d_tile_2d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                        size_t range_k, size_t range_l, size_t tile_k, size_t tile_l, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_4d_tile_2d");
    flags |= extra_flags;
    const size_t range[4] = {range_i, range_j, range_k, range_l};
    int swap;
    tile_l = pick_tile(4, function, context, range, tile_k, tile_l, &swap);
    if (swap) {
        struct swapped s = {function, context};
        fn(pool, (task_t) swapped_4d, &s, range_i, range_j, range_l, range_k, tile_l, tile_k, flags);
    } else {
        fn(pool, function, context, range_i, range_j, range_k, range_l, tile_k, tile_l, flags);
    }
}

/* 5-D and 6-D tiled loops (no conv / fc uses them): recorded and re-tiled, never reordered. */
void pthreadpool_parallelize_5d_tile_2d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                        size_t range_k, size_t range_l, size_t range_m, size_t tile_l, size_t tile_m,
                                        uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_5d_tile_2d");
    flags |= extra_flags;
    const size_t range[5] = {range_i, range_j, range_k, range_l, range_m};
    int swap;
    tile_m = pick_tile(5, function, context, range, tile_l, tile_m, &swap);
    fn(pool, function, context, range_i, range_j, range_k, range_l, range_m, tile_l, tile_m, flags);
}

void pthreadpool_parallelize_6d_tile_2d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                        size_t range_k, size_t range_l, size_t range_m, size_t range_n, size_t tile_m,
                                        size_t tile_n, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t,
                      uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_6d_tile_2d");
    flags |= extra_flags;
    const size_t range[6] = {range_i, range_j, range_k, range_l, range_m, range_n};
    int swap;
    tile_n = pick_tile(6, function, context, range, tile_m, tile_n, &swap);
    fn(pool, function, context, range_i, range_j, range_k, range_l, range_m, range_n, tile_m, tile_n, flags);
}

/* The other parallel loops XNNPack calls (depthwise, pooling, elementwise, ...): forwarded with
 * the extra flags only. */
void pthreadpool_parallelize_1d(pool_t pool, task_t function, void* context, size_t range, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_1d");
    fn(pool, function, context, range, flags | extra_flags);
}

void pthreadpool_parallelize_1d_tile_1d(pool_t pool, task_t function, void* context, size_t range, size_t tile,
                                        uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_1d_tile_1d");
    fn(pool, function, context, range, tile, flags | extra_flags);
}

void pthreadpool_parallelize_2d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_2d");
    fn(pool, function, context, range_i, range_j, flags | extra_flags);
}

void pthreadpool_parallelize_2d_tile_1d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                        size_t tile_j, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_2d_tile_1d");
    fn(pool, function, context, range_i, range_j, tile_j, flags | extra_flags);
}

void pthreadpool_parallelize_3d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                size_t range_k, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_3d");
    fn(pool, function, context, range_i, range_j, range_k, flags | extra_flags);
}

void pthreadpool_parallelize_4d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                size_t range_k, size_t range_l, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_4d");
    fn(pool, function, context, range_i, range_j, range_k, range_l, flags | extra_flags);
}

void pthreadpool_parallelize_5d(pool_t pool, task_t function, void* context, size_t range_i, size_t range_j,
                                size_t range_k, size_t range_l, size_t range_m, uint32_t flags) {
    static void (*fn)(pool_t, task_t, void*, size_t, size_t, size_t, size_t, size_t, uint32_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_5d");
    fn(pool, function, context, range_i, range_j, range_k, range_l, range_m, flags | extra_flags);
}

/* A no-op with xnn_run_operator's arguments: kselect times its executor's dispatch loop with it. */
int kselect_shim_noop(void* op, void* pool) {
    (void) op;
    (void) pool;
    return 0;
}


/* Hands the pool's cores back: one empty parallel loop with PTHREADPOOL_FLAG_YIELD_WORKERS (2),
 * after which its workers sleep in the kernel instead of spinning for their next command. Run at
 * the end of an XNNPack segment of a plan that mixes libraries, so that the next library's
 * threads get both cores at once. */
static void nothing(void* context, size_t i) {
    (void) context;
    (void) i;
}

int kselect_shim_release(pool_t pool) {
    static void (*fn)(pool_t, task_t, void*, size_t, uint32_t) = NULL;
    static size_t (*count)(pool_t) = NULL;
    if (fn == NULL) fn = real("pthreadpool_parallelize_1d");
    if (count == NULL) count = real("pthreadpool_get_threads_count");
    if (fn == NULL || count == NULL || pool == NULL) return -1;
    fn(pool, (task_t) nothing, NULL, count(pool), 2);
    return 0;
}
