/* indexcore._spans: the backfill catalog's columns of many records at once (daemon/backfill/catalog.py).
 *
 * catalog_columns  one pass over a batch decoded with CATALOG_FIELDS (_kernels.c), in CommitLog order, that
 *                  fills every per-record column's Arrow buffers with the rows already grouped (each row's
 *                  group is given; a group's rows stay in CommitLog order): the batch's header fields, the
 *                  TAGS, REAL_TOPIC and REAL_QID values the decode found (REAL_QID as Integer.parseInt reads
 *                  an optional sign and 1 to 10 ASCII digits within int32), the offset msgId
 *                  (MessageDecoder.createMessageId: the store host address and port, then the CommitLog
 *                  offset, upper-case hex), KEYS' non-empty tokens between spaces, UNIQ_KEY, the body; and
 *                  each group's store host when all its records share one, so that a staged group can leave
 *                  its msgIds out (they are the host's hex, the same in every row, then the offset's:
 *                  `msg_ids` makes them again).
 * msg_ids          the offset msgIds of many records of one store host, from their CommitLog offsets.
 *
 * The pass never reads a record (only a body, with the bodies): the decode copied every string it needs
 * into the batch's text while the record was in the cache. Reading the records again, a window after the
 * decode had read them, cost 0.21-0.27 us a record, against 0.10 on records still in the cache. Each
 * group's strings go to a region of each buffer sized for the group's rows, and the regions are closed up
 * when every row is done (only the KEYS tokens leave a gap: the spaces). Six passes over the batch, one per
 * step, each read every row again; one pass reads it once. The caller owns every output buffer and sizes
 * it; the GIL is released while copying.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>


static int get(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes is not a whole number of items", what, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *v, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&v[i]);
}

/* --- catalog_columns ------------------------------------------------------------------------------------- */

/* the decode's CATALOG_FIELDS rows, in _kernels.c's order (R_BORN_TIMESTAMP .. R_HOST_LEN) */
enum { F_BORN_TIME, F_BODY_AT, F_BODY_LEN, F_TAGS_AT, F_TAGS_LEN, F_REAL_TOPIC_AT, F_REAL_TOPIC_LEN, F_REAL_QID_AT,
       F_REAL_QID_LEN, F_HOST_AT, F_HOST_LEN, F_COUNT };
#define HOST_V4_LENGTH 8
#define HOST_V6_LENGTH 20
#define KEYS_SEPARATOR ' '
#define PHYSICAL_OFFSET_SIZE 8
#define MSG_ID_CHARS(host_len) (2 * ((host_len) + PHYSICAL_OFFSET_SIZE))  /* the host's hex, then the offset's */
#define CHUNK_ROWS 2048
static const char HEX[] = "0123456789ABCDEF";
static uint8_t HEX2[256][2];  /* each byte as its two upper-case hex digits (filled at import) */

/* the columns, in the order of the out64, out32, offsets and bitmap rows and of the data buffers */
enum { C_OFFSET, C_QUEUE_OFFSET, C_STORE_TIME, C_BORN_TIME, C_TAGS_CODE, C64 };
enum { C_SIZE, C_QUEUE_ID, C_SYS_FLAG, C_BODY_SIZE, C_REAL_QID, C32 };
enum { S_TAGS, S_KEYS, S_UNIQ, S_MSGID, S_REAL_TOPIC, S_BODY, S_TOKENS, SDATA };  /* S_KEYS: each record's first token */
#define REGIONS SDATA  /* a group's region in each data buffer (S_TAGS .. S_BODY) and in the tokens (S_TOKENS) */
enum { V_TAGS, V_KEYS, V_UNIQ, V_REAL_TOPIC, V_REAL_QID, NVALID };

/* Integer.parseInt as the catalog reads REAL_QID: an optional sign, 1 to 10 ASCII digits, within int32 */
static int java_int(const uint8_t *b, int64_t n, int32_t *out) {
    int64_t i = 0, neg = 0, v = 0;
    if (n > 0 && (b[0] == '+' || b[0] == '-')) neg = b[i++] == '-';
    if (n - i < 1 || n - i > 10) return 0;
    for (; i < n; i++) {
        if (b[i] < '0' || b[i] > '9') return 0;
        v = 10 * v + (b[i] - '0');
    }
    v = neg ? -v : v;
    if (v < INT32_MIN || v > INT32_MAX) return 0;
    *out = (int32_t)v;
    return 1;
}

/* the OR of n bytes, 8 at a time: bit 7 set when one of them is not ASCII */
static inline uint8_t or_bytes(const uint8_t *b, int64_t n) {
    uint64_t acc = 0, w;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, b + i, 8);
        acc |= w;
    }
    for (; i < n; i++) acc |= b[i];
    acc |= acc >> 32;
    acc |= acc >> 16;
    acc |= acc >> 8;
    return (uint8_t)acc;
}

/* a group's region of one output buffer: data[at, end) */
typedef struct {
    int64_t at, end;
} Region;

static inline int region_put(uint8_t *data, Region *r, const uint8_t *b, int64_t n, uint8_t *high) {
    if (n > r->end - r->at) return -1;
    memcpy(data + r->at, b, (size_t)n);
    if (high) *high |= or_bytes(b, n);
    r->at += n;
    return 0;
}

/* whether the host at h (len bytes) is the group's so far: the first record's is kept in `kept` (its length
 * in *kept_len, 0 before the first, -1 once two differ) */
static inline void same_host(const uint8_t *h, int64_t len, uint8_t *kept, int64_t *kept_len) {
    if (*kept_len == 0) {
        memcpy(kept, h, (size_t)len);
        *kept_len = len;
    } else if (*kept_len > 0 && (*kept_len != len || memcmp(kept, h, (size_t)len) != 0)) {
        *kept_len = -1;
    }
}

/* catalog_columns(source, group int32[n], groups, phy int64[n], size int32[n], queue_id int32[n],
 *                 queue_offset int64[n], sys_flag int32[n], store_time int64[n], tags_code int64[n],
 *                 fields int64[F_COUNT * n], text, keys_at int64[n], keys_len int64[n], uniq_at int64[n],
 *                 uniq_len int64[n], with_body, with_msg_ids, out64 int64[C64 * n], out32 int32[C32 * n],
 *                 offsets int32[(S_TOKENS) * (n + 1)], token_offsets int32[], valid uint8[NVALID * ceil(n / 8)],
 *                 data_0 .. data_(SDATA - 2) uint8[])
 * -> (bytes used in each data buffer, tokens, nulls of each V_ column, non-ASCII bit per S_ column, hosts)
 * The batch's columns and `fields` (the decode's CATALOG_FIELDS rows, F_*), whose spans lie in `text` (the
 * bodies in `source`, the segment image). hosts: per group, the store host address and port all its records
 * share (b"" for a group without rows, None when they differ). Without with_msg_ids the msgId buffer is left
 * empty (each row's msgId empty). Batch row r is in group[r] (0 <= group[r] < groups); the output holds
 * group 0's rows, then group 1's, each group's in batch order. A data buffer holds at least its spans' bytes
 * (the KEYS spans' for the tokens, 2 * (host + 8) a row for the msgIds); token_offsets one more than the KEYS
 * spans' bytes. */
static PyObject *py_catalog_columns(PyObject *self, PyObject *args) {
    enum { SRC, GROUP, PHY, SIZE, QID, QOFF, FLAG, STIME, TCODE, FIELDS, TEXT, KAT, KLEN, UAT, ULEN, O64, O32, OFFS,
           TOKS, VALID, DATA0, NB = DATA0 + SDATA - 1 };
    PyObject *o[NB];
    long long groups;
    int with_body, with_msg_ids;
    if (!PyArg_ParseTuple(args, "OOLOOOOOOOOOOOOOppOOOOOOOOOOO", &o[SRC], &o[GROUP], &groups, &o[PHY], &o[SIZE],
                          &o[QID], &o[QOFF], &o[FLAG], &o[STIME], &o[TCODE], &o[FIELDS], &o[TEXT], &o[KAT], &o[KLEN],
                          &o[UAT], &o[ULEN], &with_body, &with_msg_ids, &o[O64], &o[O32], &o[OFFS], &o[TOKS],
                          &o[VALID], &o[DATA0], &o[DATA0 + 1], &o[DATA0 + 2], &o[DATA0 + 3], &o[DATA0 + 4],
                          &o[DATA0 + 5]))
        return NULL;
    static const Py_ssize_t sizes[NB] = {1, 4, 8, 4, 4, 8, 4, 8, 8, 8, 1, 8, 8, 8, 8, 8, 4, 4, 4, 1, 1, 1, 1, 1, 1, 1};
    static const char *names[NB] = {"source", "group", "phy", "size", "queue_id", "queue_offset", "sys_flag",
                                    "store_time", "tags_code", "fields", "text", "keys_at", "keys_len", "uniq_at",
                                    "uniq_len", "out64", "out32", "offsets", "token_offsets", "valid", "tags", "keys",
                                    "uniq", "msg_ids", "real_topic", "body"};
    Py_buffer v[NB];
    int got = 0;
    int64_t *scratch = NULL, *perm = NULL;
    uint8_t *hosts = NULL;
    for (; got < NB; got++)
        if (get(o[got], &v[got], got >= O64, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t n = v[PHY].len / 8, nb = (n + 7) / 8;
    int per_row[] = {GROUP, SIZE, QID, FLAG};
    int per_row64[] = {QOFF, STIME, TCODE, KAT, KLEN, UAT, ULEN};
    int disagree = v[FIELDS].len / 8 != F_COUNT * n || v[O64].len / 8 < C64 * n || v[O32].len / 4 < C32 * n
                   || v[OFFS].len / 4 < S_TOKENS * (n + 1) || v[VALID].len < NVALID * nb || v[TOKS].len / 4 < 1
                   || groups < 1 || groups > (n > 0 ? n : 1);
    for (size_t k = 0; k < sizeof(per_row) / sizeof(per_row[0]); k++) disagree |= v[per_row[k]].len / 4 != n;
    for (size_t k = 0; k < sizeof(per_row64) / sizeof(per_row64[0]); k++) disagree |= v[per_row64[k]].len / 8 != n;
    if (disagree) {
        PyErr_SetString(PyExc_ValueError, "catalog_columns: columns disagree in length");
        goto fail;
    }
    const uint8_t *src = v[SRC].buf, *text = v[TEXT].buf;
    const int32_t *group = v[GROUP].buf, *size = v[SIZE].buf, *queue_id = v[QID].buf, *sys_flag = v[FLAG].buf;
    const int64_t *phy = v[PHY].buf, *queue_offset = v[QOFF].buf, *store_time = v[STIME].buf, *tcode = v[TCODE].buf;
    const int64_t *kat = v[KAT].buf, *klen = v[KLEN].buf, *uat = v[UAT].buf, *ulen = v[ULEN].buf;
    const int64_t *field = v[FIELDS].buf;
#define F(f, r) field[(f) * n + (r)]
    int64_t *o64 = v[O64].buf;
    int32_t *o32 = v[O32].buf, *offs = v[OFFS].buf, *toks = v[TOKS].buf;
    uint8_t *valid = v[VALID].buf;
    uint8_t *data[SDATA - 1];
    for (int c = 0; c < SDATA - 1; c++) data[c] = v[DATA0 + c].buf;
    /* per group: its first output row and the next one (rows), and its region of each buffer (base: where the
     * region starts, region: where the next byte or token goes and where the region ends) */
    int64_t G = groups;
    scratch = PyMem_Malloc(sizeof(int64_t) * (size_t)(3 * G + REGIONS * (G + 1)) + sizeof(Region) * (size_t)(REGIONS * G));
    hosts = PyMem_Malloc((size_t)(HOST_V6_LENGTH * G));
    perm = PyMem_Malloc(sizeof(int64_t) * (size_t)(G > 1 ? n + G + 1 : 1));
    int64_t *count = perm + n;  /* a chunk's rows per group, then where each group's next row goes */
    if (scratch == NULL || hosts == NULL || perm == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t *first = scratch, *next = scratch + G, *host_len_of = scratch + 2 * G;  /* hosts: same_host's */
    int64_t *base = scratch + 3 * G;                                       /* base[s * (G + 1) + g] */
    Region *region = (Region *)(base + REGIONS * (G + 1));                /* region[s * G + g] */
    memset(scratch, 0, sizeof(int64_t) * (size_t)(3 * G + REGIONS * (G + 1)));
    const char *bad = NULL;
    int64_t bad_at = 0;
    /* every span lies in `text` (a body in the source) and each group's share of every buffer: checked before
     * anything is read */
    static const int spans[][2] = {{F_TAGS_AT, F_TAGS_LEN}, {F_REAL_TOPIC_AT, F_REAL_TOPIC_LEN},
                                   {F_REAL_QID_AT, F_REAL_QID_LEN}, {F_HOST_AT, F_HOST_LEN}};
    for (Py_ssize_t r = 0; r < n && !bad; r++) {
        int64_t g = group[r];
        if (g < 0 || g >= G) { bad = "group"; bad_at = g; break; }
        if (kat[r] >= 0 && (klen[r] < 0 || kat[r] + klen[r] > v[TEXT].len)) { bad = "KEYS span"; bad_at = phy[r]; break; }
        if (uat[r] >= 0 && (ulen[r] < 0 || uat[r] + ulen[r] > v[TEXT].len)) { bad = "UNIQ_KEY span"; bad_at = phy[r]; break; }
        for (size_t k = 0; k < sizeof(spans) / sizeof(spans[0]); k++) {
            int64_t at = F(spans[k][0], r), len = F(spans[k][1], r);
            if (at >= 0 && (len < 0 || at + len > v[TEXT].len)) { bad = "catalog field span"; bad_at = phy[r]; break; }
        }
        int64_t host_len = F(F_HOST_LEN, r);
        if (F(F_HOST_AT, r) < 0 || (host_len != HOST_V4_LENGTH && host_len != HOST_V6_LENGTH)) { bad = "store host"; bad_at = phy[r]; break; }
        if (with_body && (F(F_BODY_AT, r) < 0 || F(F_BODY_LEN, r) < 0 || F(F_BODY_AT, r) + F(F_BODY_LEN, r) > v[SRC].len)) {
            bad = "body"; bad_at = phy[r]; break;
        }
        int64_t keys = kat[r] >= 0 ? klen[r] : 0;
        first[g]++;
        base[S_TAGS * (G + 1) + g + 1] += F(F_TAGS_AT, r) >= 0 ? F(F_TAGS_LEN, r) : 0;
        base[S_KEYS * (G + 1) + g + 1] += keys;
        base[S_UNIQ * (G + 1) + g + 1] += uat[r] >= 0 ? ulen[r] : 0;
        base[S_MSGID * (G + 1) + g + 1] += with_msg_ids ? MSG_ID_CHARS(host_len) : 0;
        base[S_REAL_TOPIC * (G + 1) + g + 1] += F(F_REAL_TOPIC_AT, r) >= 0 ? F(F_REAL_TOPIC_LEN, r) : 0;
        base[S_BODY * (G + 1) + g + 1] += with_body ? F(F_BODY_LEN, r) : 0;
        base[S_TOKENS * (G + 1) + g + 1] += keys;  /* a token is at least a byte */
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "catalog_columns: %s at %lld outside the buffers", bad, (long long)bad_at);
        goto fail;
    }
    for (int s = 0; s < REGIONS; s++) {
        int64_t *b = base + s * (G + 1);
        for (int64_t g = 0; g < G; g++) b[g + 1] += b[g];
        int64_t room = s == S_TOKENS ? v[TOKS].len / 4 - 1 : v[DATA0 + s].len;
        if (b[G] > room) {
            PyErr_Format(PyExc_ValueError, "catalog_columns: the %s buffer is too small", names[s == S_TOKENS ? TOKS : DATA0 + s]);
            goto fail;
        }
        for (int64_t g = 0; g < G; g++) region[s * G + g] = (Region){b[g], b[g + 1]};
    }
    for (int64_t g = 0, row = 0; g < G; g++) {  /* first[g] held the group's rows */
        int64_t rows = first[g];
        first[g] = next[g] = row;
        row += rows;
    }
    memset(valid, 0, (size_t)(NVALID * nb));
    int64_t tokens = 0, nulls[NVALID] = {0}, used[SDATA - 1] = {0};
    uint8_t high[SDATA - 1] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int c = 0; c < S_TOKENS; c++) offs[c * (n + 1)] = 0;
    toks[0] = 0;
    /* The rows of each chunk of CHUNK_ROWS in group order (a counting sort; the whole batch at once when the
     * groups outnumber a chunk's rows): each group's rows of a chunk are then written one after another, and
     * what they read lies in a chunk that stays in the cache. Rows visited in batch order write each column
     * in as many places as there are groups (8 groups: 0.22-0.24 us a row); all rows in group order read
     * every input once per group (0.18-0.20); by chunks of 2048 rows, 0.15-0.18 (512: 0.21-0.24). */
    if (G > 1) {
        int64_t chunk = G > CHUNK_ROWS ? n : CHUNK_ROWS;
        for (Py_ssize_t c0 = 0; c0 < n; c0 += chunk) {
            Py_ssize_t c1 = c0 + chunk < n ? c0 + chunk : n;
            memset(count, 0, sizeof(int64_t) * (size_t)(G + 1));
            for (Py_ssize_t r = c0; r < c1; r++) count[group[r] + 1]++;
            for (int64_t g = 0; g < G; g++) count[g + 1] += count[g];
            for (Py_ssize_t r = c0; r < c1; r++) perm[c0 + count[group[r]]++] = r;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t r = G > 1 ? perm[k] : k, g = group[r], i = next[g]++;  /* its output row */
        o64[C_OFFSET * n + i] = phy[r];
        o64[C_QUEUE_OFFSET * n + i] = queue_offset[r];
        o64[C_STORE_TIME * n + i] = store_time[r];
        o64[C_BORN_TIME * n + i] = F(F_BORN_TIME, r);
        o64[C_TAGS_CODE * n + i] = tcode[r];
        o32[C_SIZE * n + i] = size[r];
        o32[C_QUEUE_ID * n + i] = queue_id[r];
        o32[C_SYS_FLAG * n + i] = sys_flag[r];
        o32[C_BODY_SIZE * n + i] = (int32_t)F(F_BODY_LEN, r);

        int64_t tags_at = F(F_TAGS_AT, r), topic_at = F(F_REAL_TOPIC_AT, r), qid_at = F(F_REAL_QID_AT, r);
        int32_t qid = 0;
        int present[NVALID] = {tags_at >= 0, kat[r] >= 0, uat[r] >= 0, topic_at >= 0,
                               qid_at >= 0 && java_int(text + qid_at, F(F_REAL_QID_LEN, r), &qid)};
        o32[C_REAL_QID * n + i] = qid;
        for (int c = 0; c < NVALID; c++) {
            if (present[c]) valid[c * nb + i / 8] |= (uint8_t)(1u << (i % 8));
            else nulls[c]++;
        }
        Region *reg = region + g;  /* reg[s * G]: this group's region of buffer s */
        if ((tags_at >= 0
             && region_put(data[S_TAGS], &reg[S_TAGS * G], text + tags_at, F(F_TAGS_LEN, r), &high[S_TAGS]) < 0)
            || (topic_at >= 0
                && region_put(data[S_REAL_TOPIC], &reg[S_REAL_TOPIC * G], text + topic_at, F(F_REAL_TOPIC_LEN, r),
                              &high[S_REAL_TOPIC]) < 0)
            || (uat[r] >= 0 && region_put(data[S_UNIQ], &reg[S_UNIQ * G], text + uat[r], ulen[r], &high[S_UNIQ]) < 0)
            || (with_body
                && region_put(data[S_BODY], &reg[S_BODY * G], src + F(F_BODY_AT, r), F(F_BODY_LEN, r), NULL) < 0)) {
            bad = "output";
            break;
        }
        /* KEYS: its non-empty tokens between spaces */
        Region *keys = &reg[S_KEYS * G], *toks_at = &reg[S_TOKENS * G];
        if (kat[r] >= 0) {
            for (int64_t a = kat[r], kend = kat[r] + klen[r]; a < kend;) {
                const uint8_t *sp = memchr(text + a, KEYS_SEPARATOR, (size_t)(kend - a));
                int64_t e = sp ? sp - text : kend;
                if (e > a) {
                    if (toks_at->at == toks_at->end
                        || region_put(data[S_KEYS], keys, text + a, e - a, &high[S_KEYS]) < 0) { bad = "output"; break; }
                    toks[++toks_at->at] = (int32_t)keys->at;
                }
                a = e + 1;
            }
            if (bad) break;
        }
        /* msgId: the store host's address and port, then the CommitLog offset, in upper-case hex */
        const uint8_t *host = text + F(F_HOST_AT, r);
        int64_t host_len = F(F_HOST_LEN, r);
        same_host(host, host_len, hosts + HOST_V6_LENGTH * g, &host_len_of[g]);
        Region *id = &reg[S_MSGID * G];
        if (with_msg_ids) {
            if (MSG_ID_CHARS(host_len) > id->end - id->at) { bad = "output"; break; }
            uint8_t *hex = data[S_MSGID] + id->at;
            for (int64_t b = 0; b < host_len; b++, hex += 2) memcpy(hex, HEX2[host[b]], 2);
            for (int b = 7; b >= 0; b--, hex += 2) memcpy(hex, HEX2[(uint8_t)((uint64_t)phy[r] >> (8 * b))], 2);
            id->at = hex - data[S_MSGID];
        }
        offs[S_TAGS * (n + 1) + i + 1] = (int32_t)reg[S_TAGS * G].at;
        offs[S_KEYS * (n + 1) + i + 1] = (int32_t)toks_at->at;
        offs[S_UNIQ * (n + 1) + i + 1] = (int32_t)reg[S_UNIQ * G].at;
        offs[S_MSGID * (n + 1) + i + 1] = (int32_t)id->at;
        offs[S_REAL_TOPIC * (n + 1) + i + 1] = (int32_t)reg[S_REAL_TOPIC * G].at;
        offs[S_BODY * (n + 1) + i + 1] = (int32_t)reg[S_BODY * G].at;
    }
#undef F
    if (!bad) {
        /* close up the regions, group by group: each group's bytes (or tokens) move down to follow the group
         * before, and its rows' offsets by as much; a token's offset moves with the KEYS bytes */
        for (int s = 0; s < REGIONS; s++) {
            int64_t packed = 0;
            for (int64_t g = 0; g < G; g++) {
                int64_t from = base[s * (G + 1) + g], count = region[s * G + g].at - from, shift = from - packed;
                int64_t rows_end = g + 1 < G ? first[g + 1] : n;
                if (shift && s == S_TOKENS) {
                    memmove(toks + packed + 1, toks + from + 1, sizeof(int32_t) * (size_t)count);
                    for (int64_t j = first[g]; j < rows_end; j++) offs[S_KEYS * (n + 1) + j + 1] -= (int32_t)shift;
                } else if (shift) {
                    memmove(data[s] + packed, data[s] + from, (size_t)count);
                    if (s == S_KEYS)  /* the group's tokens: still where the group's region put them */
                        for (int64_t k = base[S_TOKENS * (G + 1) + g]; k < region[S_TOKENS * G + g].at; k++)
                            toks[k + 1] -= (int32_t)shift;
                    else
                        for (int64_t j = first[g]; j < rows_end; j++) offs[s * (n + 1) + j + 1] -= (int32_t)shift;
                }
                packed += count;
            }
            if (s == S_TOKENS) tokens = packed;
            else used[s] = packed;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        if (bad[0] == 'o') PyErr_SetString(PyExc_ValueError, "catalog_columns: an output buffer is too small");
        else PyErr_Format(PyExc_ValueError, "catalog_columns: the %s at %lld does not decode", bad, (long long)bad_at);
        goto fail;
    }
    int non_ascii = 0;
    for (int c = 0; c < SDATA - 1; c++) non_ascii |= (high[c] & 0x80) ? 1 << c : 0;
    PyObject *host_list = PyList_New((Py_ssize_t)G);
    for (int64_t g = 0; host_list != NULL && g < G; g++) {
        PyObject *h = host_len_of[g] < 0 ? Py_NewRef(Py_None)
                      : PyBytes_FromStringAndSize((const char *)hosts + HOST_V6_LENGTH * g, (Py_ssize_t)host_len_of[g]);
        if (h == NULL) Py_CLEAR(host_list);
        else PyList_SET_ITEM(host_list, (Py_ssize_t)g, h);
    }
    PyMem_Free(scratch);
    PyMem_Free(hosts);
    PyMem_Free(perm);
    release(v, NB);
    if (host_list == NULL) return NULL;
    return Py_BuildValue("((LLLLLL)L(LLLLL)iN)", (long long)used[0], (long long)used[1],
                         (long long)used[2], (long long)used[3], (long long)used[4],
                         (long long)used[5], (long long)tokens, (long long)nulls[0],
                         (long long)nulls[1], (long long)nulls[2], (long long)nulls[3],
                         (long long)nulls[4], non_ascii, host_list);
fail:
    PyMem_Free(scratch);
    PyMem_Free(hosts);
    PyMem_Free(perm);
    release(v, got);
    return NULL;
}

/* msg_ids(phy int64[n], host bytes, out uint8[n * 2 * (len(host) + 8)]): each record's offset msgId
 * (MessageDecoder.createMessageId, as catalog_columns writes it), all of one length, one after another */
static PyObject *py_msg_ids(PyObject *self, PyObject *args) {
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    Py_buffer v[3];
    int got = 0;
    static const Py_ssize_t sizes[3] = {8, 1, 1};
    static const char *names[3] = {"phy", "host", "out"};
    for (; got < 3; got++)
        if (get(o[got], &v[got], got == 2, sizes[got], names[got]) < 0) {
            release(v, got);
            return NULL;
        }
    Py_ssize_t n = v[0].len / 8, host_len = v[1].len, width = MSG_ID_CHARS(host_len);
    if ((host_len != HOST_V4_LENGTH && host_len != HOST_V6_LENGTH) || v[2].len < n * width) {
        PyErr_SetString(PyExc_ValueError, "msg_ids: a host is 8 or 20 bytes, and out holds every msgId");
        release(v, 3);
        return NULL;
    }
    const int64_t *phy = v[0].buf;
    const uint8_t *host = v[1].buf;
    uint8_t *out = v[2].buf, prefix[2 * HOST_V6_LENGTH];
    for (Py_ssize_t b = 0; b < host_len; b++) memcpy(prefix + 2 * b, HEX2[host[b]], 2);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) {
        uint8_t *hex = out + r * width;
        memcpy(hex, prefix, (size_t)(2 * host_len));
        hex += 2 * host_len;
        for (int b = 7; b >= 0; b--, hex += 2) memcpy(hex, HEX2[(uint8_t)((uint64_t)phy[r] >> (8 * b))], 2);
    }
    Py_END_ALLOW_THREADS
    release(v, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"catalog_columns", py_catalog_columns, METH_VARARGS,
     "catalog_columns(...) -> (bytes, tokens, nulls, non_ascii, hosts): every per-record catalog column in one pass"},
    {"msg_ids", py_msg_ids, METH_VARARGS, "msg_ids(phy, host, out): the offset msgIds of one store host's records"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "indexcore._spans", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__spans(void) {
    for (int b = 0; b < 256; b++) {
        HEX2[b][0] = (uint8_t)HEX[b >> 4];
        HEX2[b][1] = (uint8_t)HEX[b & 15];
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    static const struct { const char *name; long value; } constants[] = {
        {"C_OFFSET", C_OFFSET}, {"C_QUEUE_OFFSET", C_QUEUE_OFFSET}, {"C_STORE_TIME", C_STORE_TIME},
        {"C_BORN_TIME", C_BORN_TIME}, {"C_TAGS_CODE", C_TAGS_CODE}, {"C64", C64},
        {"C_SIZE", C_SIZE}, {"C_QUEUE_ID", C_QUEUE_ID}, {"C_SYS_FLAG", C_SYS_FLAG}, {"C_BODY_SIZE", C_BODY_SIZE},
        {"C_REAL_QID", C_REAL_QID}, {"C32", C32},
        {"S_TAGS", S_TAGS}, {"S_KEYS", S_KEYS}, {"S_UNIQ", S_UNIQ}, {"S_MSGID", S_MSGID},
        {"S_REAL_TOPIC", S_REAL_TOPIC}, {"S_BODY", S_BODY}, {"S_TOKENS", S_TOKENS},
        {"V_TAGS", V_TAGS}, {"V_KEYS", V_KEYS}, {"V_UNIQ", V_UNIQ}, {"V_REAL_TOPIC", V_REAL_TOPIC},
        {"V_REAL_QID", V_REAL_QID}, {"NVALID", NVALID},
        {"F_BORN_TIME", F_BORN_TIME}, {"F_BODY_AT", F_BODY_AT}, {"F_BODY_LEN", F_BODY_LEN}, {"F_TAGS_AT", F_TAGS_AT},
        {"F_TAGS_LEN", F_TAGS_LEN}, {"F_REAL_TOPIC_AT", F_REAL_TOPIC_AT}, {"F_REAL_TOPIC_LEN", F_REAL_TOPIC_LEN},
        {"F_REAL_QID_AT", F_REAL_QID_AT}, {"F_REAL_QID_LEN", F_REAL_QID_LEN}, {"F_HOST_AT", F_HOST_AT},
        {"F_HOST_LEN", F_HOST_LEN}, {"F_COUNT", F_COUNT},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
