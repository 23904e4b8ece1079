/*
 * The directory tier (tier.h): one file per page object,
 *
 *     PATH/<ns hex>/<first 2 key hex>/<key hex>.kvp
 *
 * A namespace is a directory so that invalidate is one rename plus a
 * recursive removal, and the 2-hex level keeps each listing small.
 *
 * Writes go to a private temporary file in PATH/tmp/ and are renamed onto
 * the final name: rename() is atomic, so a reader (any process) sees the
 * old object, the new one or none, never part of one. A killed writer
 * leaves only its temporary file, which the next open removes once it is
 * STALE_TMP_S old (a younger one may belong to a live writer). There is no
 * fsync: a power loss may leave a renamed file with zeros or holes, but the
 * store verifies every object's checksum when it loads it, so such a file is
 * a counted miss, never wrong K/V.
 *
 * Budget (?max_bytes=N): an in-memory index (key -> size, last use) of the
 * whole directory, rebuilt by listing it at open so that it survives
 * restarts, and re-listed by a write once it is RESCAN_S old (other
 * processes share the directory; their writes and evictions reach this index
 * only then, so across processes the budget is approximate). Last use is the
 * file's mtime: a hit sets it to now (atime would do, but noatime mounts
 * disable it), and a write sets it anyway, so LRU order is "last read or
 * written" for every process. Eviction drops the least recently used
 * objects (ties: by namespace, then key) until the total fits, after
 * checking each victim's mtime (evict). Without a
 * budget there is no index and no listing: open stays cheap on big trees.
 *
 * Threads (tier.h: probe/get/invalidate from any threads, put from the
 * writer's): the index sits under one mutex; file I/O runs outside it.
 */
#define _POSIX_C_SOURCE 200809L /* openat, fdopendir, futimens, st_mtim */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../core/internal.h"
#include "tier.h"

enum {
    STALE_TMP_S = 60, /* a temporary file this old belongs to a dead writer */
    RESCAN_S = 10,    /* an index this old is re-listed by the next write */
    ROOT_MAX = 3900,  /* PATH length limit: object paths add 74 bytes */
    PATH_BUF = 4096,
};

/* One object of the index: a node of its hash chain and of the LRU list. */
typedef struct ent {
    kvc_store_key ns, key;
    uint64_t size;
    int64_t used;            /* last use, ns since the epoch */
    struct ent *hnext;       /* hash chain */
    struct ent *prev, *next; /* LRU list, least recently used first */
} ent;

typedef struct dindex {
    ent **b;         /* buckets, nb a power of 2 (or 0) */
    size_t nb, n;
    uint64_t bytes;  /* sum of sizes */
    ent *head, *tail;
} dindex;

typedef struct dir_tier {
    kvc_tier base;
    char *root;         /* PATH */
    uint64_t max_bytes; /* 0: no budget, no index */
    pthread_mutex_t mu; /* guards what follows */
    dindex idx;
    int64_t scanned_at; /* CLOCK_MONOTONIC ns of the listing idx came from */
    uint64_t inval_gen; /* bumped by invalidate: a listing made across it is stale */
    int made_root, made_tmp; /* open created PATH, PATH/tmp: a failed open removes them */
} dir_tier;

static atomic_uint_fast64_t tmp_counter; /* unique temporary names within a process */

static int64_t now_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- names ---------------------------------------------------------------- */

static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1; /* upper case is not ours: kvc__store_key_hex writes lower */
}

/* 0 if s starts with 32 hex digits, stored into k. */
static int parse_hex32(const char *s, kvc_store_key *k) {
    for (int i = 0; i < 16; i++) {
        int hi = hex_val(s[2 * i]), lo = hi < 0 ? -1 : hex_val(s[2 * i + 1]);
        if (lo < 0) return -1;
        k->b[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

/* PATH/<ns> (depth 0), PATH/<ns>/<xx> (1) or PATH/<ns>/<xx>/<key>.kvp (2). */
static void obj_path(const dir_tier *d, const kvc_store_key *ns, const kvc_store_key *key,
                     int depth, char out[PATH_BUF]) {
    char nh[33], kh[33];
    kvc__store_key_hex(ns, nh);
    kvc__store_key_hex(key, kh);
    if (depth == 0) snprintf(out, PATH_BUF, "%s/%s", d->root, nh);
    else if (depth == 1) snprintf(out, PATH_BUF, "%s/%s/%.2s", d->root, nh, kh);
    else snprintf(out, PATH_BUF, "%s/%s/%.2s/%s.kvp", d->root, nh, kh, kh);
}

/* ---- index ---------------------------------------------------------------- */

static size_t ent_hash(const kvc_store_key *ns, const kvc_store_key *key) {
    uint64_t w[4];
    memcpy(w, key->b, 16);
    memcpy(w + 2, ns->b, 16);
    uint64_t h = w[0] ^ (w[1] * 0x9e3779b97f4a7c15ull) ^ (w[2] * 0xbf58476d1ce4e5b9ull) ^ w[3];
    h ^= h >> 31;
    h *= 0x94d049bb133111ebull;
    return (size_t)(h ^ (h >> 29));
}

static ent *idx_find(const dindex *ix, const kvc_store_key *ns, const kvc_store_key *key) {
    if (!ix->nb) return NULL;
    for (ent *e = ix->b[ent_hash(ns, key) & (ix->nb - 1)]; e; e = e->hnext)
        if (!memcmp(e->key.b, key->b, 16) && !memcmp(e->ns.b, ns->b, 16)) return e;
    return NULL;
}

static void lru_unlink(dindex *ix, ent *e) {
    if (e->prev) e->prev->next = e->next;
    else ix->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else ix->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push(dindex *ix, ent *e) {
    e->prev = ix->tail;
    e->next = NULL;
    if (ix->tail) ix->tail->next = e;
    else ix->head = e;
    ix->tail = e;
}

/* Adds e (not in ix) to the hash and the LRU tail; -1 when out of memory. */
static int idx_add(dindex *ix, ent *e) {
    if (ix->n >= ix->nb) { /* load factor 1: double */
        size_t nb = ix->nb ? 2 * ix->nb : 64;
        ent **b = calloc(nb, sizeof *b);
        if (!b) return -1;
        for (size_t i = 0; i < ix->nb; i++)
            for (ent *x = ix->b[i], *nx; x; x = nx) {
                nx = x->hnext;
                size_t h = ent_hash(&x->ns, &x->key) & (nb - 1);
                x->hnext = b[h];
                b[h] = x;
            }
        free(ix->b);
        ix->b = b;
        ix->nb = nb;
    }
    size_t h = ent_hash(&e->ns, &e->key) & (ix->nb - 1);
    e->hnext = ix->b[h];
    ix->b[h] = e;
    lru_push(ix, e);
    ix->n++;
    ix->bytes += e->size;
    return 0;
}

/* Takes e out of ix (the caller frees it). */
static void idx_del(dindex *ix, ent *e) {
    ent **pp = &ix->b[ent_hash(&e->ns, &e->key) & (ix->nb - 1)];
    while (*pp != e) pp = &(*pp)->hnext;
    *pp = e->hnext;
    lru_unlink(ix, e);
    ix->n--;
    ix->bytes -= e->size;
}

static void idx_free(dindex *ix) {
    for (ent *e = ix->head, *nx; e; e = nx) {
        nx = e->next;
        free(e);
    }
    free(ix->b);
    memset(ix, 0, sizeof *ix);
}

/* A write or a hit: the object is now the most recently used. insert: add it
 * when unknown (a write); a hit on an object the index does not know (another
 * process wrote it) waits for the next listing. Best effort: out of memory
 * only leaves the budget counting low. Under d->mu. */
static void idx_touch(dir_tier *d, const kvc_store_key *ns, const kvc_store_key *key,
                      uint64_t size, int insert) {
    dindex *ix = &d->idx;
    ent *e = idx_find(ix, ns, key);
    int64_t now = now_ns(CLOCK_REALTIME);
    if (e) {
        ix->bytes = ix->bytes - e->size + size;
        e->size = size;
        lru_unlink(ix, e);
        lru_push(ix, e);
    } else if (insert && (e = calloc(1, sizeof *e))) {
        e->ns = *ns;
        e->key = *key;
        e->size = size;
        if (idx_add(ix, e)) free(e), e = NULL;
    }
    /* The list, not the clock, orders this process's uses; keep used in step
     * so a later listing agrees even if the clock stepped back. */
    if (e) e->used = e->prev && e->prev->used > now ? e->prev->used : now;
}

static void idx_touch_locked(dir_tier *d, const kvc_store_key *ns, const kvc_store_key *key,
                             uint64_t size, int insert) {
    pthread_mutex_lock(&d->mu);
    idx_touch(d, ns, key, size, insert);
    pthread_mutex_unlock(&d->mu);
}

static int ent_cmp(const void *a, const void *b) {
    const ent *x = *(const ent *const *)a, *y = *(const ent *const *)b;
    if (x->used != y->used) return x->used < y->used ? -1 : 1;
    int c = memcmp(x->ns.b, y->ns.b, 16);
    return c ? c : memcmp(x->key.b, y->key.b, 16);
}

/* ---- listing -------------------------------------------------------------- */

/* Opens name under dfd as a directory stream; NULL (errno set) if it cannot. */
static DIR *open_sub(int dfd, const char *name) {
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return NULL;
    DIR *dir = fdopendir(fd);
    if (!dir) close(fd);
    return dir;
}

/* Adds the objects of PATH/<ns>/<xx>/ to ix; -1 when out of memory. */
static int scan_leaf(DIR *dir, const kvc_store_key *ns, const char *xx, dindex *ix) {
    struct dirent *de;
    while ((de = readdir(dir))) {
        const char *nm = de->d_name;
        kvc_store_key key;
        struct stat st;
        if (strlen(nm) != 36 || strcmp(nm + 32, ".kvp") || memcmp(nm, xx, 2) ||
            parse_hex32(nm, &key))
            continue;
        if (fstatat(dirfd(dir), nm, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode)) continue;
        ent *e = calloc(1, sizeof *e);
        if (!e) return -1;
        e->ns = *ns;
        e->key = key;
        e->size = (uint64_t)st.st_size;
        e->used = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
        if (idx_add(ix, e)) return free(e), -1;
    }
    return 0;
}

/* Lists every namespace under PATH into ix. Directories that vanish
 * meanwhile (invalidate, other processes) are skipped. */
static kvc_status scan(const dir_tier *d, dindex *ix) {
    DIR *top = opendir(d->root);
    if (!top)
        return kvc__error(KVC_ERR_IO, "dir tier: cannot list %.200s: %s", d->root, strerror(errno));
    int oom = 0;
    struct dirent *de;
    while (!oom && (de = readdir(top))) {
        kvc_store_key ns;
        if (strlen(de->d_name) != 32 || parse_hex32(de->d_name, &ns)) continue;
        DIR *nsd = open_sub(dirfd(top), de->d_name);
        if (!nsd) continue;
        struct dirent *sub;
        while (!oom && (sub = readdir(nsd))) {
            const char *xx = sub->d_name;
            if (strlen(xx) != 2 || hex_val(xx[0]) < 0 || hex_val(xx[1]) < 0) continue;
            DIR *leaf = open_sub(dirfd(nsd), xx);
            if (!leaf) continue;
            oom = scan_leaf(leaf, &ns, xx, ix) != 0;
            closedir(leaf);
        }
        closedir(nsd);
    }
    closedir(top);
    return oom ? kvc__error(KVC_ERR_NOMEM, "dir tier %.200s: out of memory listing", d->root)
               : KVC_OK;
}

/* Replaces d->idx by a fresh listing, sorted by last use. Uses this process
 * made during the listing are kept (the later time wins). On failure, or
 * when a namespace was invalidated meanwhile (the listing may hold its
 * objects), the old index stays and the next write lists again. */
static kvc_status rescan(dir_tier *d) {
    pthread_mutex_lock(&d->mu);
    uint64_t gen = d->inval_gen;
    pthread_mutex_unlock(&d->mu);
    int64_t t0 = now_ns(CLOCK_MONOTONIC);
    dindex nx = {0};
    kvc_status st = scan(d, &nx);
    ent **arr = st == KVC_OK ? malloc((nx.n ? nx.n : 1) * sizeof *arr) : NULL;
    if (st == KVC_OK && !arr) st = kvc__error(KVC_ERR_NOMEM, "dir tier: out of memory");
    pthread_mutex_lock(&d->mu);
    if (st == KVC_OK && d->inval_gen == gen) {
        size_t k = 0;
        for (ent *e = nx.head; e; e = e->next) {
            const ent *o = idx_find(&d->idx, &e->ns, &e->key);
            if (o && o->used > e->used) e->used = o->used;
            arr[k++] = e;
        }
        qsort(arr, k, sizeof *arr, ent_cmp);
        nx.head = nx.tail = NULL;
        for (size_t i = 0; i < k; i++) lru_push(&nx, arr[i]);
        dindex old = d->idx;
        d->idx = nx;
        nx = old;
        d->scanned_at = t0;
    }
    pthread_mutex_unlock(&d->mu);
    free(arr);
    idx_free(&nx);
    return st;
}

/* ---- removal -------------------------------------------------------------- */

/* Removes name under pfd, a file or a tree (depth-limited: ours is 3 deep).
 * Already gone is fine. A writer that looked its path up before the tree
 * was renamed away may still add a file to it: ENOTEMPTY lists it again.
 * 0, or -1 with errno set. */
static int rm_tree(int pfd, const char *name, int depth) {
    if (unlinkat(pfd, name, 0) == 0 || errno == ENOENT) return 0;
    if (errno != EISDIR && errno != EPERM) return -1; /* EPERM: POSIX for a directory */
    for (int pass = 0; pass < 4; pass++) {
        DIR *dir = open_sub(pfd, name);
        if (!dir) return errno == ENOENT ? 0 : -1;
        struct dirent *de;
        int err = 0;
        while ((de = readdir(dir)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") &&
                (depth >= 8 || rm_tree(dirfd(dir), de->d_name, depth + 1)))
                err = depth >= 8 ? ELOOP : errno;
        closedir(dir);
        if (err) return errno = err, -1;
        if (unlinkat(pfd, name, AT_REMOVEDIR) == 0 || errno == ENOENT) return 0;
        if (errno != ENOTEMPTY && errno != EEXIST) return -1; /* EEXIST: POSIX allows it */
    }
    return -1;
}

/* Removes temporary files (and half-removed namespaces) in PATH/tmp older
 * than STALE_TMP_S: their writer died. */
static void clean_tmp(const dir_tier *d) {
    char p[PATH_BUF];
    snprintf(p, sizeof p, "%s/tmp", d->root);
    DIR *dir = opendir(p);
    if (!dir) return;
    int64_t now = now_ns(CLOCK_REALTIME);
    struct dirent *de;
    while ((de = readdir(dir))) {
        struct stat st;
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (fstatat(dirfd(dir), de->d_name, &st, AT_SYMLINK_NOFOLLOW)) continue;
        if (now - ((int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec) >
            (int64_t)STALE_TMP_S * 1000000000)
            rm_tree(dirfd(dir), de->d_name, 0);
    }
    closedir(dir);
}

/* Adds e (not in ix) at its place in the LRU list by last use (evict's
 * refreshed victims: usually near the tail, so the walk is short). */
static void idx_add_sorted(dindex *ix, ent *e) {
    if (idx_add(ix, e)) { /* out of memory: the budget counts low until a listing */
        free(e);
        return;
    }
    while (e->prev && ent_cmp(&e->prev, &e) > 0) {
        ent *p = e->prev;
        lru_unlink(ix, e);
        e->prev = p->prev, e->next = p; /* e goes just before p */
        if (p->prev) p->prev->next = e;
        else ix->head = e;
        p->prev = e;
    }
}

/* Puts e, taken out of ix by evict, back at the LRU head (least recently
 * used: the next eviction tries it first). */
static void idx_put_back(dindex *ix, ent *e) {
    if (idx_add(ix, e)) { /* out of memory: the budget counts low until a listing */
        free(e);
        return;
    }
    lru_unlink(ix, e);
    e->next = ix->head;
    if (ix->head) ix->head->prev = e;
    else ix->tail = e;
    ix->head = e;
}

/* Puts evict's spared victims (a list through next) back into the index
 * with put. An invalidate meanwhile may have taken their namespace (its
 * entries left the index then): those wait for the next listing. */
static void reinsert(dir_tier *d, ent *list, uint64_t gen, void (*put)(dindex *, ent *)) {
    pthread_mutex_lock(&d->mu);
    for (ent *e = list, *nx; e; e = nx) {
        nx = e->next;
        e->prev = e->next = NULL;
        if (d->inval_gen == gen && !idx_find(&d->idx, &e->ns, &e->key)) put(&d->idx, e);
        else free(e);
    }
    pthread_mutex_unlock(&d->mu);
}

/* After a write: re-lists the directory once the index is RESCAN_S old
 * (other processes' writes count towards the budget too), then drops least
 * recently used objects until the budget holds. The victims leave the index
 * under the lock; files and callbacks follow outside it. A victim among
 * keys[0..n) of ns (the put call's objects so far) gets written[j] = 0: the
 * store announces an object stored after put returns, which for an object
 * already gone would follow its removal and outlive it at the subscriber.
 * A victim whose file is newer than the index says (its mtime: another
 * process read or rewrote it since this index learned of it) is no victim
 * yet: it takes its file's time and size and goes back into the index at its
 * place by last use, so two processes sharing the directory do not evict
 * each other's hot objects between listings. A call spares at most as many
 * victims as its index held, which bounds the loop. The check and the
 * unlink are not atomic: a use in between still loses that object (a
 * future miss, never wrong K/V).
 * A victim whose file cannot be removed (unlink fails, e.g. EIO, EROFS, an
 * immutable file) is still there: it gets no removed callback, stays
 * written, goes back into the index at the LRU head (its bytes still count,
 * so the next least recently used objects go instead) and is tried first
 * by the next eviction. ENOENT is a removal: another process evicted or
 * invalidated it first. */
static void evict(dir_tier *d, const kvc_store_key *ns, const kvc_store_key *keys, int64_t n,
                  unsigned char *written) {
    pthread_mutex_lock(&d->mu);
    int stale = now_ns(CLOCK_MONOTONIC) - d->scanned_at > (int64_t)RESCAN_S * 1000000000;
    pthread_mutex_unlock(&d->mu);
    if (stale) (void)rescan(d); /* a failed listing: go on with what we have */
    ent *stuck = NULL;      /* victims that stayed, out of the index meanwhile: newest first */
    uint64_t stuck_bytes = 0;
    pthread_mutex_lock(&d->mu);
    const uint64_t gen = d->inval_gen;
    size_t refresh = d->idx.n; /* mtime checks that may spare a victim: ends the loop */
    pthread_mutex_unlock(&d->mu);
    char p[PATH_BUF];
    for (;;) {
        ent *victims = NULL, **tail = &victims;
        pthread_mutex_lock(&d->mu);
        while (d->idx.bytes + stuck_bytes > d->max_bytes && d->idx.head) {
            ent *e = d->idx.head;
            idx_del(&d->idx, e);
            *tail = e;
            tail = &e->next;
        }
        pthread_mutex_unlock(&d->mu);
        if (!victims) break;
        ent *fresh = NULL; /* victims another process used since: back in line */
        for (ent *e = victims, *nx; e; e = nx) {
            nx = e->next;
            obj_path(d, &e->ns, &e->key, 2, p);
            struct stat st;
            if (refresh > 0 && lstat(p, &st) == 0 && S_ISREG(st.st_mode)) {
                const int64_t m = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
                if (m > e->used) {
                    refresh--;
                    e->used = m, e->size = (uint64_t)st.st_size;
                    e->next = fresh;
                    fresh = e;
                    continue;
                }
            }
            if (unlink(p) != 0 && errno != ENOENT) {
                e->next = stuck;
                stuck = e;
                stuck_bytes += e->size;
                continue;
            }
            for (int64_t j = 0; written && j < n; j++)
                if (!memcmp(e->key.b, keys[j].b, 16) && !memcmp(e->ns.b, ns->b, 16))
                    written[j] = 0;
            if (d->base.removed) d->base.removed(d->base.removed_user, &e->ns, &e->key);
            free(e);
        }
        reinsert(d, fresh, gen, idx_add_sorted);
    }
    /* Newest first onto the head: the oldest ends up first, as before. */
    reinsert(d, stuck, gen, idx_put_back);
}

/* ---- operations ----------------------------------------------------------- */

static kvc_status dir_probe(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                            int64_t n, int64_t *n_present) {
    dir_tier *d = (dir_tier *)t;
    KVC_CHECK(n_present, "dir tier probe: n_present is NULL");
    *n_present = 0;
    KVC_CHECK(ns && n >= 0 && (keys || n == 0), "dir tier probe: bad arguments (n=%lld)",
              (long long)n);
    char p[PATH_BUF];
    for (int64_t i = 0; i < n; i++) {
        struct stat st;
        obj_path(d, ns, &keys[i], 2, p);
        if (stat(p, &st) != 0) {
            if (errno == ENOENT || errno == ENOTDIR) break;
            return kvc__error(KVC_ERR_IO, "dir tier: cannot stat %.200s: %s", p, strerror(errno));
        }
        *n_present = i + 1;
    }
    return KVC_OK;
}

/* Whether a failed open says nothing about the file itself: the process
 * or the system is short of descriptors or memory, so every file would
 * fail alike (an error of the call, not a miss of one key). */
static int process_limit(int e) { return e == EMFILE || e == ENFILE || e == ENOMEM; }

/* Reads one file into *obj, a buffer of pool: whole, or its first
 * max_len + 1 bytes when larger (tier.h); *file_size: its size. *obj stays
 * NULL when there is no object to read: absent, shortened meanwhile, or
 * unreadable (no permission, a directory or a FIFO at the key's path, an
 * I/O error): a miss for this key only, whatever the batch's other keys
 * hold. An error only when no file could be read (out of descriptors or
 * memory). O_NONBLOCK: opening a FIFO planted under a key would wait for a
 * writer forever (regular files ignore the flag). */
static kvc_status read_obj(kvc__objpool *pool, const char *p, size_t max_len, void **obj,
                           size_t *len, uint64_t *file_size) {
    int fd = open(p, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return process_limit(errno) ? kvc__error(KVC_ERR_IO, "dir tier: cannot open %.200s: %s",
                                                 p, strerror(errno))
                                    : KVC_OK;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return KVC_OK;
    }
    if (max_len > SIZE_MAX / 2) max_len = SIZE_MAX / 2;
    const size_t size = (uint64_t)st.st_size > max_len ? max_len + 1 : (size_t)st.st_size;
    *file_size = (uint64_t)st.st_size;
    char *buf = kvc__objpool_get(pool, size);
    if (!buf) {
        close(fd);
        return kvc__error(KVC_ERR_NOMEM, "dir tier: out of memory (%zu bytes)", size);
    }
    size_t got = 0;
    int bad = 0;
    while (!bad && got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno != EINTR) bad = 1; /* EIO, EISDIR: this file's miss */
        if (r == 0) break; /* shorter than fstat said: not a whole object, a miss */
        if (r > 0) got += (size_t)r;
    }
    if (!bad && got == size) {
        /* mtime = now marks the use for every process's LRU (header comment);
         * not an oversized file's: it is no object */
        const struct timespec ts[2] = {{0, UTIME_OMIT}, {0, UTIME_NOW}};
        if ((uint64_t)size == (uint64_t)st.st_size) (void)futimens(fd, ts);
        *obj = buf, *len = size;
        buf = NULL;
    }
    kvc__objpool_put(pool, buf, size);
    close(fd);
    return KVC_OK;
}

static kvc_status dir_get(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                          int64_t n, size_t max_len, int64_t deadline_ns, void **objs,
                          size_t *lens) {
    dir_tier *d = (dir_tier *)t;
    KVC_CHECK(ns && n >= 0 && ((keys && objs && lens) || n == 0),
              "dir tier get: bad arguments (n=%lld)", (long long)n);
    for (int64_t i = 0; i < n; i++) objs[i] = NULL, lens[i] = 0;
    char p[PATH_BUF];
    /* the clock per file (a vDSO read, no syscall): a deadline passed
     * leaves the rest unread (tier.h) */
    for (int64_t i = 0; i < n && !(deadline_ns && now_ns(CLOCK_MONOTONIC) >= deadline_ns); i++) {
        obj_path(d, ns, &keys[i], 2, p);
        uint64_t fsize = 0;
        kvc_status st = read_obj(t->pool, p, max_len, &objs[i], &lens[i], &fsize);
        if (st != KVC_OK) {
            for (int64_t j = 0; j < i; j++)
                kvc__objpool_put(t->pool, objs[j], lens[j]), objs[j] = NULL, lens[j] = 0;
            return st;
        }
        if (objs[i] && d->max_bytes) idx_touch_locked(d, ns, &keys[i], fsize, 0);
    }
    return KVC_OK;
}

/* Creates PATH/<ns>/<xx>/; 0 or an errno. */
static int make_dirs(const dir_tier *d, const kvc_store_key *ns, const kvc_store_key *key) {
    char p[PATH_BUF];
    for (int depth = 0; depth < 2; depth++) {
        obj_path(d, ns, key, depth, p);
        if (mkdir(p, 0755) != 0 && errno != EEXIST) return errno;
    }
    return 0;
}

/* A new temporary file in PATH/tmp, named by pid, a process-wide counter and
 * clock bits: unique among live writers; O_EXCL catches a dead one's name. */
static int open_tmp(const dir_tier *d, char p[PATH_BUF]) {
    for (int attempt = 0; attempt < 16; attempt++) {
        uint64_t c = atomic_fetch_add(&tmp_counter, 1);
        uint64_t r = (uint64_t)now_ns(CLOCK_REALTIME) * 0x9e3779b97f4a7c15ull ^ (uintptr_t)p;
        snprintf(p, PATH_BUF, "%s/tmp/%ld.%llu.%08llx.tmp", d->root, (long)getpid(),
                 (unsigned long long)c, (unsigned long long)(r >> 32));
        int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd >= 0) return fd;
        if (errno == ENOENT) { /* PATH/tmp removed by hand: recreate it */
            char td[PATH_BUF];
            snprintf(td, sizeof td, "%s/tmp", d->root);
            if (mkdir(td, 0755) != 0 && errno != EEXIST) return -1;
        } else if (errno != EEXIST) {
            return -1;
        }
    }
    errno = EEXIST;
    return -1;
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len) {
        ssize_t w = write(fd, buf, len < ((size_t)1 << 30) ? len : (size_t)1 << 30);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        if (w == 0) return errno = ENOSPC, -1;
        buf += w;
        len -= (size_t)w;
    }
    return 0;
}

/* Writes one object whole under its final name, or nothing at all. */
static kvc_status put_one(dir_tier *d, const kvc_store_key *ns, const kvc_store_key *key,
                          const void *obj, size_t len) {
    if (d->max_bytes && len > d->max_bytes)
        return kvc__error(KVC_ERR_NO_SPACE, "dir tier %.200s: object of %zu bytes exceeds "
                          "max_bytes=%llu", d->root, len, (unsigned long long)d->max_bytes);
    char tmp[PATH_BUF], dst[PATH_BUF];
    int fd = open_tmp(d, tmp);
    if (fd < 0)
        return kvc__error(KVC_ERR_IO, "dir tier: cannot create %.200s: %s", tmp, strerror(errno));
    int bad = write_all(fd, obj, len);
    int e = errno;
    if (close(fd) != 0 && !bad) bad = 1, e = errno; /* NFS reports write errors at close */
    if (bad) {
        unlink(tmp);
        return kvc__error(KVC_ERR_IO, "dir tier: cannot write %.200s: %s", tmp, strerror(e));
    }
    obj_path(d, ns, key, 2, dst);
    /* Try the rename first (the directories usually exist); on ENOENT make
     * them, again if an invalidate removes them in between (invalidations in
     * a tight loop can hit that window many times running: yield to them). */
    for (int attempt = 0; rename(tmp, dst) != 0; attempt++) {
        e = errno;
        if (e == ENOENT && attempt < 64) {
            if (attempt >= 2) sched_yield();
            int me = make_dirs(d, ns, key); /* ENOENT: PATH/<ns> went meanwhile */
            if (me == 0 || me == ENOENT) continue;
            e = me;
        }
        unlink(tmp);
        return kvc__error(KVC_ERR_IO, "dir tier: cannot rename %.200s to %.200s: %s", tmp, dst,
                          strerror(e));
    }
    if (d->max_bytes) idx_touch_locked(d, ns, key, len, 1);
    return KVC_OK;
}

static kvc_status dir_put(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                          const void *const *objs, const size_t *lens, int64_t n,
                          unsigned char *written) {
    dir_tier *d = (dir_tier *)t;
    if (written && n > 0) memset(written, 0, (size_t)n);
    KVC_CHECK(ns && n >= 0 && ((keys && objs && lens) || n == 0),
              "dir tier put: bad arguments (n=%lld)", (long long)n);
    for (int64_t i = 0; i < n; i++)
        KVC_CHECK(objs[i] || lens[i] == 0, "dir tier put: object %lld is NULL", (long long)i);
    /* Each object on its own: one that cannot be written (over the budget,
     * a directory at its path) costs only itself; the first error is kept. */
    kvc_status ret = KVC_OK;
    char first[512] = ""; /* its message: later failures overwrite kvc_last_error */
    for (int64_t i = 0; i < n; i++) {
        kvc_status st = put_one(d, ns, &keys[i], objs[i], lens[i]);
        if (st != KVC_OK) {
            if (ret == KVC_OK) ret = st, snprintf(first, sizeof first, "%s", kvc_last_error());
            continue;
        }
        if (written) written[i] = 1;
        if (d->max_bytes) evict(d, ns, keys, i + 1, written);
    }
    return ret == KVC_OK ? KVC_OK : kvc__error(ret, "%s", first);
}

/* Invalidate succeeds once the namespace's objects are out of every
 * reader's view: the rename. Removing the renamed tree is housekeeping: a
 * failure there (an entry that cannot be removed, a tree deeper than ours)
 * leaves the directory in PATH/tmp for a later open's clean-up (clean_tmp)
 * and is no error, since the objects are gone (the store announces the
 * namespace cleared). A failed rename removed nothing: the call fails and
 * the index keeps the namespace's objects (they still count in the budget
 * and can be evicted). */
static kvc_status dir_invalidate(kvc_tier *t, const kvc_store_key *ns, int *removed) {
    dir_tier *d = (dir_tier *)t;
    if (removed) *removed = 0;
    KVC_CHECK(ns, "dir tier invalidate: ns is NULL");
    /* Rename the namespace away first: its objects vanish at once for every
     * reader, and writers racing us start a fresh directory. */
    char src[PATH_BUF], dst[PATH_BUF], nh[33];
    kvc__store_key_hex(ns, nh);
    obj_path(d, ns, ns, 0, src);
    snprintf(dst, sizeof dst, "%s/tmp/inval.%ld.%llu.%s", d->root, (long)getpid(),
             (unsigned long long)atomic_fetch_add(&tmp_counter, 1), nh);
    int rc = rename(src, dst);
    if (rc != 0 && errno == ENOENT) {
        /* No such namespace, or PATH/tmp removed by hand. Told apart by
         * PATH/tmp, not by src, which a racing writer may create any time
         * after the rename (it starts afresh, as after a rename). */
        char td[PATH_BUF];
        snprintf(td, sizeof td, "%s/tmp", d->root);
        if (access(td, F_OK) != 0 && (mkdir(td, 0755) == 0 || errno == EEXIST))
            rc = rename(src, dst);
        if (rc != 0 && errno == ENOENT) rc = 1; /* nothing to remove */
    }
    if (rc < 0)
        return kvc__error(KVC_ERR_IO, "dir tier: cannot rename %.200s to %.200s: %s", src, dst,
                          strerror(errno));
    if (removed) *removed = rc == 0;
    if (rc == 0) (void)rm_tree(AT_FDCWD, dst, 0); /* failed: the next open retries it */
    if (d->max_bytes) {
        pthread_mutex_lock(&d->mu);
        for (ent *e = d->idx.head, *nx; e; e = nx) {
            nx = e->next;
            if (!memcmp(e->ns.b, ns->b, 16)) idx_del(&d->idx, e), free(e);
        }
        d->inval_gen++;
        pthread_mutex_unlock(&d->mu);
    }
    return KVC_OK;
}

static void dir_close(kvc_tier *t) {
    dir_tier *d = (dir_tier *)t;
    if (!d) return;
    idx_free(&d->idx);
    pthread_mutex_destroy(&d->mu);
    free(d->root);
    free(d);
}

/* Undoes open: removes PATH/tmp and PATH if open created them and they are
 * still empty (rmdir, never a file: whatever anyone put there stays). */
static void dir_abandon(kvc_tier *t) {
    dir_tier *d = (dir_tier *)t;
    char p[PATH_BUF];
    snprintf(p, sizeof p, "%s/tmp", d->root);
    if (d->made_tmp) (void)rmdir(p);
    if (d->made_root) (void)rmdir(d->root);
    d->made_tmp = d->made_root = 0;
}

static const kvc_tier_ops dir_ops = {dir_probe,      dir_get,   dir_put,
                                     dir_invalidate, dir_close, dir_abandon};

/* ---- open ----------------------------------------------------------------- */

/* "max_bytes=N[K|M|G]" (the text after '?') into *out. */
static kvc_status parse_query(const char *url, const char *q, uint64_t *out) {
    static const char name[] = "max_bytes=";
    KVC_CHECK(!strncmp(q, name, sizeof name - 1),
              "dir tier URL \"%.200s\": unknown option \"%.40s\" (the only one is max_bytes=N)",
              url, q);
    const char *s = q + sizeof name - 1;
    uint64_t v = 0;
    int digits = 0;
    for (; *s >= '0' && *s <= '9'; s++, digits++) {
        KVC_CHECK(v <= (UINT64_MAX - 9) / 10, "dir tier URL \"%.200s\": max_bytes too large",
                  url);
        v = v * 10 + (uint64_t)(*s - '0');
    }
    KVC_CHECK(digits > 0, "dir tier URL \"%.200s\": max_bytes needs a number of bytes, "
              "optionally with K, M or G (2^10, 2^20, 2^30), e.g. max_bytes=512M", url);
    int shift = *s == 'K' ? 10 : *s == 'M' ? 20 : *s == 'G' ? 30 : 0;
    if (shift) s++;
    KVC_CHECK(*s == 0, "dir tier URL \"%.200s\": unexpected \"%.40s\" after max_bytes's "
              "number (suffixes: K, M, G; no other option)", url, s);
    KVC_CHECK(v > 0, "dir tier URL \"%.200s\": max_bytes must be positive", url);
    KVC_CHECK(v <= (uint64_t)INT64_MAX >> shift, "dir tier URL \"%.200s\": max_bytes too large",
              url);
    *out = v << shift;
    return KVC_OK;
}

/* mkdir p unless it is a directory already; *made = 1 when this call
 * created it (only that one may be removed again by a failed open). */
static kvc_status ensure_dir(const char *p, int *made) {
    struct stat st;
    if (mkdir(p, 0755) == 0) *made = 1;
    else if (errno != EEXIST)
        return kvc__error(KVC_ERR_IO, "dir tier: cannot create directory %.200s: %s", p,
                          strerror(errno));
    if (stat(p, &st) != 0)
        return kvc__error(KVC_ERR_IO, "dir tier: cannot stat %.200s: %s", p, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return kvc__error(KVC_ERR_IO, "dir tier: %.200s is not a directory", p);
    return KVC_OK;
}

kvc_status kvc__tier_dir_open(const char *url, kvc_tier **out) {
    KVC_CHECK(out, "dir tier: out is NULL");
    *out = NULL;
    KVC_CHECK(url, "dir tier: URL is NULL");
    KVC_CHECK(!strncmp(url, "dir:", 4),
              "dir tier URL \"%.200s\": must be dir:PATH or dir:PATH?max_bytes=N", url);
    const char *path = url + 4, *q = strchr(path, '?');
    size_t plen = q ? (size_t)(q - path) : strlen(path);
    KVC_CHECK(plen > 0, "dir tier URL \"%.200s\": empty PATH (dir:PATH)", url);
    KVC_CHECK(plen <= ROOT_MAX, "dir tier URL: PATH longer than %d bytes", ROOT_MAX);
    uint64_t max_bytes = 0;
    if (q) KVC_TRY(parse_query(url, q + 1, &max_bytes));

    dir_tier *d = calloc(1, sizeof *d);
    char *root = malloc(plen + 1);
    if (!d || !root) {
        free(d);
        free(root);
        return kvc__error(KVC_ERR_NOMEM, "dir tier: out of memory");
    }
    memcpy(root, path, plen);
    root[plen] = 0;
    d->root = root;
    d->max_bytes = max_bytes;
    d->base.ops = &dir_ops;
    memcpy(d->base.kind, "dir", 4);
    snprintf(d->base.name, sizeof d->base.name, "%.*s", (int)sizeof d->base.name - 1, url);
    if (pthread_mutex_init(&d->mu, NULL) != 0) {
        free(root);
        free(d);
        return kvc__error(KVC_ERR_NOMEM, "dir tier: cannot create a mutex");
    }
    char tp[PATH_BUF];
    snprintf(tp, sizeof tp, "%s/tmp", root);
    kvc_status st = ensure_dir(root, &d->made_root);
    if (st == KVC_OK) st = ensure_dir(tp, &d->made_tmp);
    if (st == KVC_OK) clean_tmp(d);
    /* No eviction here: the store sets the removed callback after open, and
     * the first put past the budget evicts anyway. */
    if (st == KVC_OK && max_bytes) st = rescan(d);
    if (st != KVC_OK) {
        dir_abandon(&d->base);
        dir_close(&d->base);
        return st;
    }
    *out = &d->base;
    return KVC_OK;
}
