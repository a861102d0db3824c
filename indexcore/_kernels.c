/* indexcore._kernels: the per-record loops of the dispatch path, in C.
 *
 * decode_window  one pass over a window of CommitLog records: header fields, body CRC, topic, the
 *                KEYS/UNIQ_KEY/TAGS/DELAY properties, the TAGS hash and the IndexFile hash of every
 *                "topic#key" (Java String.hashCode over UTF-16 units of the UTF-8-decoded text); with
 *                multi-dispatch on, also the queues and offsets of INNER_MULTI_DISPATCH /
 *                INNER_MULTI_QUEUE_OFFSET (multidispatch.py states the rules), one row per target.
 * put_keys       the broker's IndexFile.putKey loop, straight into the mapped file (or, for `reputd verify`,
 *                into the slots and a window of entries held in memory).
 * key_records, put_key_records, link_chains
 *                the backfill's IndexFile keys: staged as records by a decode task, put by a chunk's task
 *                into slots of its own, its chains linked to the chunks' before it.
 * group_units    the ConsumeQueue units of a batch, queue by queue in put order (consume_queue_units).
 * create_files   mappedfile.create_in_place for many files at once (the first files of the thousands of
 *                queues a batch meets), its steps in its order, with the GIL released throughout: the
 *                creating thread then does not wait for the GIL after every system call.
 * pwrite_many    the appends a batch makes to many ConsumeQueue files, in one call without the GIL (through
 *                the descriptor set's descriptors, or opening a file for its write).
 * gather_pieces  the gathered appends of many queues (slices of several batches' arrays) copied back to back
 *                into one buffer, so that each queue's are one contiguous write (QueueTable.release).
 * syncfs         syncfs(2) on the file system holding a descriptor.
 * known_names    a window's topics looked up in the names a reader has checked already, in one call.
 *
 * The record layout is the one commitlog.py documents; the offsets below are exported as module
 * attributes and a test holds them equal to commitlog.py's. Outputs go to buffers the caller owns, the
 * record and key tables column by column (column c of a table with room for N rows starts at c * N); when
 * one is full the decoder stops before the record that does not fit (STOP_FULL) and the caller
 * grows it and calls again from there, so nothing here allocates. The GIL is released while decoding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_CLMUL_CRC 1
#endif

/* CommitLog record layout (commitlog.py) */
#define MAGIC_CODE_OFFSET 4
#define BODY_CRC_OFFSET 8
#define QUEUE_ID_OFFSET 12
#define QUEUE_OFFSET_OFFSET 20
#define PHYSICAL_OFFSET_OFFSET 28
#define SYS_FLAG_OFFSET 36
#define BORN_TIMESTAMP_OFFSET 40
#define BORN_HOST_OFFSET 48
#define HOST_V4_LENGTH 8
#define HOST_V6_LENGTH 20
#define STORE_HOST_AFTER_BORN_HOST 8          /* STORETIMESTAMP comes first */
#define PREPARED_OFFSET_AFTER_STORE_HOST 4    /* after RECONSUMETIMES */
#define BODY_LENGTH_AFTER_STORE_HOST 12
#define BODY_AFTER_STORE_HOST 16
#define TOPIC_LENGTH_SIZE_V1 1
#define TOPIC_LENGTH_SIZE_V2 2
#define PROPERTIES_LENGTH_SIZE 2
#define END_FILE_MIN_BLANK_LENGTH 8
#define MIN_RECORD_SIZE 91
#define MESSAGE_MAGIC_CODE ((int32_t)0xDAA320A7)
#define MESSAGE_MAGIC_CODE_V2 ((int32_t)0xDAA320AB)
#define BLANK_MAGIC_CODE ((int32_t)0xCBD43194)
#define BODY_CRC_MASK 0x7FFFFFFF
#define BORNHOST_V6_FLAG 0x10
#define STOREHOSTADDRESS_V6_FLAG 0x20

/* DLedger entry layout (dledger.py): with DLEDGER_ENTRIES every record sits in an entry of a 48-byte header
 * (magic 1, size, index, term, pos, channel, chainCrc, bodyCrc, bodyLen) and a file ends with the DLedger
 * BLANK `int -1, int bytes left`, magic first */
#define DLEDGER_MAGIC 1
#define DLEDGER_BLANK_MAGIC (-1)
#define DLEDGER_BLANK_LENGTH 8
#define DLEDGER_SIZE_OFFSET 4
#define DLEDGER_POS_OFFSET 24
#define DLEDGER_BODY_LENGTH_OFFSET 44
#define DLEDGER_HEADER_SIZE 48

#define NAME_VALUE_SEPARATOR 0x01
#define PROPERTY_SEPARATOR 0x02
#define KEY_SEPARATOR 0x20
#define INDEX_KEY_SEPARATOR 0x23
#define REPLACEMENT_CHARACTER 0xFFFD
#define SURROGATE_MIN 0xD800
#define SURROGATE_MAX 0xDFFF

/* multi-dispatch (multidispatch.py) */
#define TRANSACTION_TYPE_MASK 0xC
#define TRANSACTION_NOT_TYPE 0x0
#define TRANSACTION_COMMIT_TYPE 0x8
#define MULTI_DISPATCH_QUEUE_SPLITTER 0x2C
#define LMQ_PREFIX "%LMQ%"
#define LMQ_PREFIX_LENGTH 5
#define LMQ_QUEUE_ID 0
#define CQ_UNIT_SIZE 20
#define MAX_MULTI_QUEUE_OFFSET (INT64_MAX / CQ_UNIT_SIZE)

/* IndexFile layout (indexfile.py) */
#define INDEX_HEADER_SIZE 40
#define HASH_SLOT_SIZE 4
#define INDEX_ENTRY_SIZE 20
#define INVALID_INDEX 0
#define FIRST_INDEX 1
#define MAX_TIME_DIFF 2147483647LL
#define MS_PER_SECOND 1000
#define PUT_KEYS_PREFETCH 16

/* stops and errors (batchdecode.py, commitlog.RECORD_ERRORS) */
enum { STOP_LIMIT, STOP_BLANK, STOP_END, STOP_ERROR, STOP_FULL };
enum {
    ERR_NO_BLANK = 1, ERR_BLANK_SIZE, ERR_MAGIC, ERR_TOTAL_SMALL, ERR_TOTAL_MAX, ERR_TOTAL_PAST,
    ERR_PHYSICAL_OFFSET, ERR_BODY_LENGTH, ERR_BODY_CRC, ERR_TOPIC_LENGTH_END, ERR_TOPIC_LENGTH,
    ERR_PROPERTIES_LENGTH, ERR_PARTS, ERR_FIXED_PART, ERR_MULTI_NO_PROPERTIES, ERR_MULTI_QUEUE_OFFSET,
    /* DLedger entry headers (dledger.py ENTRY_ERRORS) */
    ERR_ENTRY_NO_BLANK, ERR_ENTRY_BLANK_SIZE, ERR_ENTRY_MAGIC, ERR_ENTRY_SIZE, ERR_ENTRY_POS, ERR_ENTRY_BODY_LENGTH,
    ERR_ENTRY_TOTAL_SIZE
};
/* why a multi-dispatch queue offset is refused (e2 of ERR_MULTI_QUEUE_OFFSET) */
enum { OFFSET_NOT_A_NUMBER, OFFSET_NEGATIVE, OFFSET_TOO_LARGE };
/* the decode_window flags argument */
/* CATALOG_FIELDS: also what the backfill's catalog needs of each record (R_BORN_TIMESTAMP .. R_HOST_LEN), its
 * strings copied into the text while the record is in the cache: the catalog's pass then reads only
 * these columns and the text, never the records again */
enum { MULTI_DISPATCH = 1, MULTI_DISPATCH_LMQ = 2, DLEDGER_ENTRIES = 4, CATALOG_FIELDS = 8 };
/* R_MULTI: what multi-dispatch made of a record */
enum { MULTI_NONE, MULTI_DISPATCHED, MULTI_COUNT_MISMATCH };
/* which output is full (bits of e1 with STOP_FULL) */
enum { FULL_RECORDS = 1, FULL_KEYS = 2, FULL_TEXT = 4, FULL_TOPICS = 8, FULL_TABLE = 16, FULL_MULTI = 32 };

/* columns */
enum {
    R_PHY, R_SIZE, R_QUEUE_ID, R_QUEUE_OFFSET, R_SYS_FLAG, R_STORE_TIMESTAMP, R_PREPARED_OFFSET,
    R_TAGS_CODE, R_TOPIC_ID, R_KEYS_AT, R_KEYS_LEN, R_UNIQ_AT, R_UNIQ_LEN, R_DELAY_AT, R_DELAY_LEN,
    R_MULTI,
    /* with CATALOG_FIELDS only (never written otherwise): the born time, the body's place in the image, and
     * the TAGS, REAL_TOPIC and REAL_QID values and the store host's address and port as spans of the text */
    R_BORN_TIMESTAMP, R_BODY_AT, R_BODY_LEN, R_TAGS_AT, R_TAGS_LEN, R_REAL_TOPIC_AT, R_REAL_TOPIC_LEN,
    R_REAL_QID_AT, R_REAL_QID_LEN, R_HOST_AT, R_HOST_LEN, RECORD_COLUMNS
};
enum { K_HASH, K_OWNER, KEY_COLUMNS };
enum { M_OWNER, M_TOPIC_ID, M_QUEUE_ID, M_QUEUE_OFFSET, MULTI_COLUMNS };
/* T_HEAD0/T_HEAD1: the name's first 16 bytes (zero padded), compared in place of the name's first
 * occurrence, which lies anywhere in the window and is rarely in the cache */
enum { T_AT, T_LEN, T_FIRST, T_HASH, T_JAVA_PREFIX, T_ROLE, T_HEAD0, T_HEAD1, TOPIC_COLUMNS };
#define NAME_HEAD_BYTES 16
/* T_ROLE: how a name was first met in the window */
enum { ROLE_TOPIC, ROLE_MULTI_DISPATCH };
/* the in/out counters */
enum { S_RECORDS, S_KEYS, S_TEXT, S_TOPICS, S_MULTI, STATE_COLUMNS };

#define NAME_HASH_SEED 0xCBF29CE484222325ULL      /* FNV-1a's offset basis */
#define NAME_HASH_MULTIPLIER 0x9E3779B97F4A7C15ULL /* 2^64 / the golden ratio */
#define FMIX_MULTIPLIER_1 0xFF51AFD7ED558CCDULL
#define FMIX_MULTIPLIER_2 0xC4CEB9FE1A85EC53ULL

static inline int64_t be32(const uint8_t *b) {
    return (int32_t)(((uint32_t)b[0] << 24) | ((uint32_t)b[1] << 16) | ((uint32_t)b[2] << 8) | b[3]);
}
static inline int64_t be16(const uint8_t *b) { return (int16_t)(((uint16_t)b[0] << 8) | b[1]); }
static inline int64_t be64(const uint8_t *b) {
    return (int64_t)(((uint64_t)(uint32_t)be32(b) << 32) | (uint32_t)be32(b + 4));
}
static inline void put_be(uint8_t *b, uint64_t v, int size) {
    for (int i = 0; i < size; i++) b[i] = (uint8_t)(v >> (8 * (size - 1 - i)));
}

/* CRC-32 (zlib's polynomial) of a message body. zlib's table-driven crc32 manages about 1.6 GB/s here;
 * folding 64 bytes at a time with carry-less multiplication (Gopal et al., "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ", Intel 2009) runs several times faster, and the body CRC is the
 * largest single cost of a rebuild. Bodies under 64 bytes, the last len % 16 bytes, and CPUs without
 * PCLMULQDQ go through zlib. Constants are x^k mod P for the reflected polynomial, from the paper. */
#ifdef HAVE_CLMUL_CRC
#define CLMUL_CRC_MIN_LENGTH 64
static int clmul_crc_enabled;

__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_clmul(uint32_t crc, const uint8_t *p, size_t len) {
    const __m128i fold4 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL); /* x^(512+32), x^(512-32) */
    const __m128i fold1 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL); /* x^(128+32), x^(128-32) */
    const __m128i fold64 = _mm_set_epi64x(0, 0x0163cd6124LL);             /* x^64 */
    const __m128i barrett = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL); /* mu, P */
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)~crc));
    __m128i b = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(p + 48));
    p += 64;
    len -= 64;
#define FOLD(x, k, next) _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), \
                                                     _mm_clmulepi64_si128(x, k, 0x11)), next)
    for (; len >= 64; p += 64, len -= 64) {
        a = FOLD(a, fold4, _mm_loadu_si128((const __m128i *)p));
        b = FOLD(b, fold4, _mm_loadu_si128((const __m128i *)(p + 16)));
        c = FOLD(c, fold4, _mm_loadu_si128((const __m128i *)(p + 32)));
        d = FOLD(d, fold4, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    a = FOLD(a, fold1, b);
    a = FOLD(a, fold1, c);
    a = FOLD(a, fold1, d);
    for (; len >= 16; p += 16, len -= 16) a = FOLD(a, fold1, _mm_loadu_si128((const __m128i *)p));
#undef FOLD
    /* 128 -> 64 bits, then 64 -> 32 by Barrett reduction */
    a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, fold1, 0x10));
    a = _mm_xor_si128(_mm_srli_si128(a, 4), _mm_clmulepi64_si128(_mm_and_si128(a, low32), fold64, 0x00));
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(a, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    crc = ~(uint32_t)_mm_extract_epi32(_mm_xor_si128(a, t), 1);
    return len ? (uint32_t)crc32(crc, p, (uInt)len) : crc;
}
#endif

#ifdef HAVE_CLMUL_CRC
#define CLMUL_ENABLED_VALUE clmul_crc_enabled
#else
#define CLMUL_ENABLED_VALUE 0
#endif

static uint32_t body_crc32(const uint8_t *p, size_t len) {
#ifdef HAVE_CLMUL_CRC
    if (clmul_crc_enabled && len >= CLMUL_CRC_MIN_LENGTH) return crc32_clmul(0, p, len);
#endif
    return (uint32_t)crc32(0L, p, (uInt)len);
}

static inline uint32_t java_step(uint32_t h, uint32_t unit) { return h * 31u + unit; }

/* Continue Java's String.hashCode `h` over the UTF-16 units of b[0:n] decoded from UTF-8 as the JDK's
 * `new String(bytes, UTF_8)` decodes it: each maximal ill-formed subsequence becomes one U+FFFD, except
 * that an encoded surrogate (ED A0..BF xx) is taken in as a three-byte sequence and replaced whole, where
 * Python's decoder replaces its bytes one by one (tests/fixtures/java/utf8_hash_code.txt is the oracle). */
static uint32_t java_hash_utf8(const uint8_t *b, int64_t n, uint32_t h) {
    int64_t i = 0;
    while (i < n) {
        if (i + 4 <= n && ((b[i] | b[i + 1] | b[i + 2] | b[i + 3]) & 0x80) == 0) {
            h = h * (31u * 31u * 31u * 31u) + b[i] * (31u * 31u * 31u) + b[i + 1] * (31u * 31u)
                + b[i + 2] * 31u + b[i + 3];
            i += 4;
            continue;
        }
        uint32_t b0 = b[i];
        if (b0 < 0x80) {
            h = java_step(h, b0);
            i++;
            continue;
        }
        int need;
        uint32_t lo = 0x80, hi = 0xBF, cp;
        if (b0 >= 0xC2 && b0 <= 0xDF) {
            need = 1; cp = b0 & 0x1F;
        } else if (b0 >= 0xE0 && b0 <= 0xEF) {
            need = 2; cp = b0 & 0x0F;
            if (b0 == 0xE0) lo = 0xA0;
        } else if (b0 >= 0xF0 && b0 <= 0xF4) {
            need = 3; cp = b0 & 0x07;
            if (b0 == 0xF0) lo = 0x90;
            if (b0 == 0xF4) hi = 0x8F;
        } else {
            h = java_step(h, REPLACEMENT_CHARACTER);
            i++;
            continue;
        }
        int64_t j = i + 1;
        int ok = 1;
        for (int k = 0; k < need; k++) {
            if (j >= n) { ok = 0; break; }
            uint32_t c = b[j];
            if (c < (k == 0 ? lo : 0x80) || c > (k == 0 ? hi : 0xBF)) { ok = 0; break; }
            cp = (cp << 6) | (c & 0x3F);
            j++;
        }
        if (!ok || (cp >= SURROGATE_MIN && cp <= SURROGATE_MAX)) {
            h = java_step(h, REPLACEMENT_CHARACTER);
        } else if (cp >= 0x10000) {
            cp -= 0x10000;
            h = java_step(java_step(h, 0xD800 + (cp >> 10)), 0xDC00 + (cp & 0x3FF));
        } else {
            h = java_step(h, cp);
        }
        i = j;
    }
    return h;
}

/* IndexFile.indexKeyHashMethod: abs of the int32 hash, Integer.MIN_VALUE -> 0 */
static inline int64_t index_key_hash(uint32_t h) {
    int32_t s = (int32_t)h;
    if (s == INT32_MIN) return 0;
    return s < 0 ? -(int64_t)s : s;
}

static inline int name_is(const uint8_t *b, int64_t n, const char *name, int64_t len) {
    return n == len && memcmp(b, name, (size_t)len) == 0;
}

typedef struct {
    const uint8_t *buf;
    int64_t *rec, *keys, *topics, *table, *multi;
    uint8_t *text;
    int64_t cap_rec, cap_keys, cap_text, cap_topics, table_size, cap_multi;
    int64_t n, nkeys, ntext, ntopics, nmulti;
} Out;

/* The table's hash of a name, eight bytes at a time (a multiply step per word, then MurmurHash3's finaliser,
 * so that names differing in their last bytes differ in the low bits the table indexes by): with
 * multi-dispatch on, every record hashes its topic and each of its targets. */
static uint64_t name_hash(const uint8_t *b, int64_t n) {
    uint64_t h = NAME_HASH_SEED ^ (uint64_t)n, w;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        memcpy(&w, b + k, 8);
        h = (h ^ w) * NAME_HASH_MULTIPLIER;
    }
    if (k < n) {
        for (w = 0; k < n; k++) w = (w << 8) | b[k];
        h = (h ^ w) * NAME_HASH_MULTIPLIER;
    }
    h ^= h >> 33;
    h *= FMIX_MULTIPLIER_1;
    h ^= h >> 33;
    h *= FMIX_MULTIPLIER_2;
    h ^= h >> 33;
    return h >> 1;
}

/* A table slot holds the topic's id in its low 32 bits and its hash's high 32 bits above (the hash has 63
 * bits, so a slot in use is never negative): a probe rules out most other names without reading their row. */
#define SLOT_ID_BITS 32
#define SLOT_ID_MASK ((1LL << SLOT_ID_BITS) - 1)

static inline int64_t table_slot(uint64_t hash, int64_t t) {
    return (int64_t)((hash >> SLOT_ID_BITS) << SLOT_ID_BITS) | t;
}

static void table_insert(Out *o, int64_t t) {
    uint64_t mask = (uint64_t)o->table_size - 1, hash = (uint64_t)o->topics[t * TOPIC_COLUMNS + T_HASH];
    uint64_t s = hash & mask;
    while (o->table[s] >= 0) s = (s + 1) & mask;
    o->table[s] = table_slot(hash, t);
}

/* The first NAME_HEAD_BYTES of b[0:n] as two words, zero padded */
static inline void name_head(const uint8_t *b, int64_t n, uint64_t head[2]) {
    head[0] = head[1] = 0;
    int64_t m = n < NAME_HEAD_BYTES ? n : NAME_HEAD_BYTES;
    for (int64_t k = 0; k < m; k++) head[k >> 3] |= (uint64_t)b[k] << (8 * (k & 7));
}

/* b[0:n] == c[0:n], names being short: eight bytes at a time, inline */
static inline int same_name(const uint8_t *b, const uint8_t *c, int64_t n) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        uint64_t x, y;
        memcpy(&x, b + k, 8);
        memcpy(&y, c + k, 8);
        if (x != y) return 0;
    }
    for (; k < n; k++)
        if (b[k] != c[k]) return 0;
    return 1;
}

/* The id of the topic spelled b[at:at+n] in this window, or -1 if it is new and there is no room.
 * Multi-dispatch queue names share the table: each becomes a directory under consumequeue/ too. */
static int64_t topic_id(Out *o, int64_t at, int64_t n, int64_t role) {
    const uint8_t *b = o->buf;
    uint64_t f = name_hash(b + at, n);
    uint64_t mask = (uint64_t)o->table_size - 1;
    uint64_t s = f & mask, head[2];
    name_head(b + at, n, head);
    for (;;) {
        int64_t slot = o->table[s];
        if (slot < 0) break;
        if (((uint64_t)slot ^ f) >> SLOT_ID_BITS == 0) {
            int64_t t = slot & SLOT_ID_MASK, *row = o->topics + t * TOPIC_COLUMNS;
            if ((uint64_t)row[T_HASH] == f && row[T_LEN] == n && (uint64_t)row[T_HEAD0] == head[0]
                && (uint64_t)row[T_HEAD1] == head[1]
                && (n <= NAME_HEAD_BYTES
                    || same_name(b + row[T_AT] + NAME_HEAD_BYTES, b + at + NAME_HEAD_BYTES, n - NAME_HEAD_BYTES)))
                return t;
        }
        s = (s + 1) & mask;
    }
    if (o->ntopics == o->cap_topics || 2 * (o->ntopics + 1) > o->table_size) return -1;
    int64_t t = o->ntopics++;
    int64_t *row = o->topics + t * TOPIC_COLUMNS;
    row[T_AT] = at;
    row[T_LEN] = n;
    row[T_FIRST] = o->n;
    row[T_HASH] = (int64_t)f;
    row[T_JAVA_PREFIX] = java_step(java_hash_utf8(b + at, n, 0), INDEX_KEY_SEPARATOR);
    row[T_ROLE] = role;
    row[T_HEAD0] = (int64_t)head[0];
    row[T_HEAD1] = (int64_t)head[1];
    o->table[s] = table_slot(f, t);
    return t;
}

/* StringUtils.isBlank of b[0:n] decoded as Java decodes it: every char is Character.isWhitespace. Beyond
 * ASCII only these are: U+1680, U+2000..U+2006, U+2008..U+200A, U+2028, U+2029, U+205F, U+3000 (all three
 * UTF-8 bytes); anything else, U+FFFD for malformed bytes included, is not. */
static int java_blank(const uint8_t *b, int64_t n) {
    for (int64_t i = 0; i < n;) {
        uint8_t c = b[i];
        if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) {
            i++;
            continue;
        }
        if (i + 3 > n) return 0;
        uint32_t cp = ((uint32_t)c << 16) | ((uint32_t)b[i + 1] << 8) | b[i + 2];
        int ws = cp == 0xE19A80 || (cp >= 0xE28080 && cp <= 0xE2808A && cp != 0xE28087) || cp == 0xE280A8
                 || cp == 0xE280A9 || cp == 0xE2819F || cp == 0xE38080;
        if (!ws) return 0;
        i += 3;
    }
    return 1;
}

/* Java's String.split(","): where the pieces of b[at:at+n] end once trailing empty pieces are dropped,
 * and how many pieces are left (no piece at all when the text is only commas). */
static int64_t split_pieces(const uint8_t *b, int64_t at, int64_t n, int64_t *end) {
    int64_t e = at + n;
    while (e > at && b[e - 1] == MULTI_DISPATCH_QUEUE_SPLITTER) e--;
    *end = e;
    if (e == at) return 0;
    int64_t pieces = 1;
    for (const uint8_t *p = b + at; (p = memchr(p, MULTI_DISPATCH_QUEUE_SPLITTER, (size_t)(b + e - p))) != NULL; p++)
        pieces++;
    return pieces;
}

/* Long.parseLong of b[at:e] for a queue offset: an optional sign, then ASCII digits (what the broker
 * writes), in [0, MAX_MULTI_QUEUE_OFFSET]. Returns -1 with *why set otherwise. */
static int64_t parse_queue_offset(const uint8_t *b, int64_t at, int64_t e, int64_t *why) {
    int negative = 0;
    if (at < e && (b[at] == '+' || b[at] == '-')) negative = b[at++] == '-';
    if (at == e) {
        *why = OFFSET_NOT_A_NUMBER;
        return -1;
    }
    uint64_t v = 0;
    int big = 0;
    for (; at < e; at++) {
        if (b[at] < '0' || b[at] > '9') {
            *why = OFFSET_NOT_A_NUMBER;
            return -1;
        }
        if (v > (uint64_t)MAX_MULTI_QUEUE_OFFSET) big = 1;  /* stop before v * 10 could wrap */
        else v = v * 10 + (uint64_t)(b[at] - '0');
    }
    if (negative && v != 0) {  /* Java parses "-5"; the unit would go before the queue's first file */
        *why = OFFSET_NEGATIVE;
        return -1;
    }
    if (big || v > (uint64_t)MAX_MULTI_QUEUE_OFFSET) {  /* Long.MAX_VALUE or its byte position overflow */
        *why = OFFSET_TOO_LARGE;
        return -1;
    }
    return (int64_t)v;
}

typedef struct { int64_t stop, pos, err, e1, e2, e3; } Result;

static Result decode(Out *o, int64_t start, int64_t stop_at, int64_t file_size, int64_t base, int64_t max_size,
                     int check_crc, int64_t multi_flags) {
    const int multi = (multi_flags & MULTI_DISPATCH) != 0, lmq = (multi_flags & MULTI_DISPATCH_LMQ) != 0;
    const uint8_t *buf = o->buf;
    Result r = {STOP_LIMIT, start, 0, 0, 0, 0};
    const int dledger = (multi_flags & DLEDGER_ENTRIES) != 0, catalog = (multi_flags & CATALOG_FIELDS) != 0;
    int64_t pos = start, entry = start, entry_size = 0;  /* entry: where the record, or its DLedger entry, starts */
#define FAIL(code, a, b_) do { r.stop = STOP_ERROR; r.err = (code); r.e1 = (a); r.e2 = (b_); goto done; } while (0)
    while (pos < stop_at) {
        if (dledger) {  /* DLedgerCommitLog.checkMessageAndReturnSize: the entry header, then the message at +48 */
            if (pos + DLEDGER_BLANK_LENGTH > file_size) FAIL(ERR_ENTRY_NO_BLANK, 0, 0);
            int64_t entry_magic = be32(buf + pos);
            entry_size = be32(buf + pos + DLEDGER_SIZE_OFFSET);
            if (entry_magic == DLEDGER_BLANK_MAGIC) {
                if (entry_size != file_size - pos) FAIL(ERR_ENTRY_BLANK_SIZE, entry_size, file_size - pos);
                r.stop = STOP_BLANK;
                goto done;
            }
            if (entry_magic == 0 && entry_size == 0) {
                r.stop = STOP_END;
                goto done;
            }
            if (entry_magic != DLEDGER_MAGIC) FAIL(ERR_ENTRY_MAGIC, entry_magic, 0);
            if (entry_size < DLEDGER_HEADER_SIZE + MIN_RECORD_SIZE || entry_size > file_size - pos)
                FAIL(ERR_ENTRY_SIZE, entry_size, file_size - pos);
            int64_t entry_pos = be64(buf + pos + DLEDGER_POS_OFFSET);
            if (entry_pos != base + pos) FAIL(ERR_ENTRY_POS, entry_pos, base + pos);
            int64_t entry_body = be32(buf + pos + DLEDGER_BODY_LENGTH_OFFSET);
            if (entry_body != entry_size - DLEDGER_HEADER_SIZE)
                FAIL(ERR_ENTRY_BODY_LENGTH, entry_body, entry_size - DLEDGER_HEADER_SIZE);
            pos += DLEDGER_HEADER_SIZE;
        }
        if (pos + END_FILE_MIN_BLANK_LENGTH > file_size) FAIL(ERR_NO_BLANK, 0, 0);
        const uint8_t *at = buf + pos;
        int64_t total = be32(at);
        int64_t magic = be32(at + MAGIC_CODE_OFFSET);
        if (dledger && (magic == MESSAGE_MAGIC_CODE || magic == MESSAGE_MAGIC_CODE_V2)
            && total != entry_size - DLEDGER_HEADER_SIZE)
            FAIL(ERR_ENTRY_TOTAL_SIZE, total, entry_size - DLEDGER_HEADER_SIZE);
        if (magic != MESSAGE_MAGIC_CODE && magic != MESSAGE_MAGIC_CODE_V2) {
            if (dledger) {
                FAIL(ERR_MAGIC, magic, 0);  /* inside a whole entry: neither the end nor a BLANK */
            } else if (magic == BLANK_MAGIC_CODE) {
                if (total != file_size - pos) FAIL(ERR_BLANK_SIZE, total, file_size - pos);
                r.stop = STOP_BLANK;
            } else if (total == 0) {
                r.stop = STOP_END;
            } else {
                FAIL(ERR_MAGIC, magic, 0);
            }
            goto done;
        }
        if (total < MIN_RECORD_SIZE) FAIL(ERR_TOTAL_SMALL, total, 0);
        if (total > max_size) FAIL(ERR_TOTAL_MAX, total, max_size);
        if (total > file_size - pos) FAIL(ERR_TOTAL_PAST, total, file_size - pos);
        int64_t end = pos + total;
        int64_t sys_flag = be32(at + SYS_FLAG_OFFSET);
        int64_t born_end = pos + BORN_HOST_OFFSET + ((sys_flag & BORNHOST_V6_FLAG) ? HOST_V6_LENGTH : HOST_V4_LENGTH);
        int64_t store_end = born_end + STORE_HOST_AFTER_BORN_HOST
                            + ((sys_flag & STOREHOSTADDRESS_V6_FLAG) ? HOST_V6_LENGTH : HOST_V4_LENGTH);
        if (store_end + BODY_AFTER_STORE_HOST > end) FAIL(ERR_FIXED_PART, total, store_end + BODY_AFTER_STORE_HOST - pos);
        int64_t phy = be64(at + PHYSICAL_OFFSET_OFFSET);
        if (phy != base + pos) FAIL(ERR_PHYSICAL_OFFSET, phy, base + pos);
        int64_t body_len = be32(buf + store_end + BODY_LENGTH_AFTER_STORE_HOST);
        int64_t body_at = store_end + BODY_AFTER_STORE_HOST;
        if (body_len < 0 || body_at + body_len > end) FAIL(ERR_BODY_LENGTH, body_len, 0);
        int64_t p = body_at + body_len;
        if (check_crc && body_len > 0) {
            int64_t stored = be32(at + BODY_CRC_OFFSET);
            int64_t actual = (int64_t)(body_crc32(buf + body_at, (size_t)body_len) & BODY_CRC_MASK);
            if (actual != stored) FAIL(ERR_BODY_CRC, stored, actual);
        }
        int64_t topic_len;
        if (magic == MESSAGE_MAGIC_CODE) {
            if (p + TOPIC_LENGTH_SIZE_V1 > end) FAIL(ERR_TOPIC_LENGTH_END, 0, 0);
            topic_len = (int8_t)buf[p];
            p += TOPIC_LENGTH_SIZE_V1;
        } else {
            if (p + TOPIC_LENGTH_SIZE_V2 > end) FAIL(ERR_TOPIC_LENGTH_END, 0, 0);
            topic_len = be16(buf + p);
            p += TOPIC_LENGTH_SIZE_V2;
        }
        if (topic_len <= 0 || p + topic_len + PROPERTIES_LENGTH_SIZE > end) FAIL(ERR_TOPIC_LENGTH, topic_len, 0);
        int64_t topic_at = p;
        p += topic_len;
        int64_t props_len = be16(buf + p);
        p += PROPERTIES_LENGTH_SIZE;
        if (props_len < 0 || p + props_len > end) FAIL(ERR_PROPERTIES_LENGTH, props_len, 0);
        if (p + props_len != end) FAIL(ERR_PARTS, end - p - props_len, 0);

        /* properties: the last non-empty value of each wanted name wins */
        int64_t keys_at = -1, uniq_at = -1, tags_at = -1, delay_at = -1, names_at = -1, offsets_at = -1;
        int64_t keys_len = 0, uniq_len = 0, tags_len = 0, delay_len = 0, names_len = 0, offsets_len = 0;
        int64_t real_topic_at = -1, real_qid_at = -1, real_topic_len = 0, real_qid_len = 0;
        for (int64_t s = p; s < end;) {
            const uint8_t *sep = memchr(buf + s, PROPERTY_SEPARATOR, (size_t)(end - s));
            int64_t e = sep ? sep - buf : end;
            const uint8_t *nv = memchr(buf + s, NAME_VALUE_SEPARATOR, (size_t)(e - s));
            if (nv && nv + 1 < buf + e) {
                int64_t name_len = nv - (buf + s), value_at = nv + 1 - buf, value_len = e - value_at;
                const uint8_t *name = buf + s;
                if (name_is(name, name_len, "KEYS", 4)) { keys_at = value_at; keys_len = value_len; }
                else if (name_is(name, name_len, "UNIQ_KEY", 8)) { uniq_at = value_at; uniq_len = value_len; }
                else if (name_is(name, name_len, "TAGS", 4)) { tags_at = value_at; tags_len = value_len; }
                else if (name_is(name, name_len, "DELAY", 5)) { delay_at = value_at; delay_len = value_len; }
                else if (multi && name_is(name, name_len, "INNER_MULTI_DISPATCH", 20)) {
                    names_at = value_at;
                    names_len = value_len;
                } else if (multi && name_is(name, name_len, "INNER_MULTI_QUEUE_OFFSET", 24)) {
                    offsets_at = value_at;
                    offsets_len = value_len;
                } else if (catalog && name_is(name, name_len, "REAL_TOPIC", 10)) {
                    real_topic_at = value_at;
                    real_topic_len = value_len;
                } else if (catalog && name_is(name, name_len, "REAL_QID", 8)) {
                    real_qid_at = value_at;
                    real_qid_len = value_len;
                }
            }
            s = e + 1;
        }

        /* multi-dispatch targets (checkMultiDispatchQueue, multiDispatchLmqQueue): only records that get
         * a ConsumeQueue unit, NOT and COMMIT, have any */
        int64_t multi_state = MULTI_NONE, targets = 0, names_end = 0, offsets_end = 0;
        int64_t type = sys_flag & TRANSACTION_TYPE_MASK;
        if (multi && (type == TRANSACTION_NOT_TYPE || type == TRANSACTION_COMMIT_TYPE)) {
            if (props_len == 0) FAIL(ERR_MULTI_NO_PROPERTIES, 0, 0);
            if (names_at >= 0 && offsets_at >= 0 && !java_blank(buf + names_at, names_len)
                && !java_blank(buf + offsets_at, offsets_len)) {
                targets = split_pieces(buf, names_at, names_len, &names_end);
                if (targets == split_pieces(buf, offsets_at, offsets_len, &offsets_end)) {
                    multi_state = MULTI_DISPATCHED;
                } else {
                    multi_state = MULTI_COUNT_MISMATCH;
                    targets = 0;
                }
            }
        }

        /* room for this record's outputs, or stop before it */
        int64_t full = 0;
        int64_t keys_needed = (uniq_at >= 0) + (keys_len + 1) / 2;
        int64_t host_at = born_end + STORE_HOST_AFTER_BORN_HOST, host_len = store_end - host_at;
        int64_t text_needed = keys_len + uniq_len + (catalog ? tags_len + real_topic_len + real_qid_len + host_len : 0);
        if (o->n == o->cap_rec) full |= FULL_RECORDS;
        if (o->nkeys + keys_needed > o->cap_keys) full |= FULL_KEYS;
        if (o->ntext + text_needed > o->cap_text) full |= FULL_TEXT;
        if (o->nmulti + targets > o->cap_multi) full |= FULL_MULTI;
        int64_t tid = full ? 0 : topic_id(o, topic_at, topic_len, ROLE_TOPIC);
        if (tid < 0) full |= (o->ntopics == o->cap_topics ? FULL_TOPICS : 0) | FULL_TABLE;
        /* one row per target, past the committed ones until the record is taken */
        int64_t queue_id = be32(at + QUEUE_ID_OFFSET);
        for (int64_t k = 0, a = names_at, q = offsets_at; !full && k < targets; k++) {
            const uint8_t *sep = memchr(buf + a, MULTI_DISPATCH_QUEUE_SPLITTER, (size_t)(names_end - a));
            int64_t e = sep && sep - buf < names_end ? sep - buf : names_end;
            const uint8_t *qsep = memchr(buf + q, MULTI_DISPATCH_QUEUE_SPLITTER, (size_t)(offsets_end - q));
            int64_t qe = qsep && qsep - buf < offsets_end ? qsep - buf : offsets_end;
            int64_t why = 0, queue_offset = parse_queue_offset(buf, q, qe, &why);
            if (queue_offset < 0) FAIL(ERR_MULTI_QUEUE_OFFSET, k, why);
            int64_t id = topic_id(o, a, e - a, ROLE_MULTI_DISPATCH);
            if (id < 0) {
                full |= (o->ntopics == o->cap_topics ? FULL_TOPICS : 0) | FULL_TABLE;
                break;
            }
            int64_t row = o->nmulti + k;
            int is_lmq = lmq && e - a >= LMQ_PREFIX_LENGTH && memcmp(buf + a, LMQ_PREFIX, LMQ_PREFIX_LENGTH) == 0;
            o->multi[M_OWNER * o->cap_multi + row] = o->n;
            o->multi[M_TOPIC_ID * o->cap_multi + row] = id;
            o->multi[M_QUEUE_ID * o->cap_multi + row] = is_lmq ? LMQ_QUEUE_ID : queue_id;
            o->multi[M_QUEUE_OFFSET * o->cap_multi + row] = queue_offset;
            a = e + 1;
            q = qe + 1;
        }
        if (full) {
            r.stop = STOP_FULL;
            r.e1 = full;
            r.e2 = keys_needed;
            r.e3 = text_needed;
            goto done;
        }
        o->nmulti += targets;

#define ROW(c) o->rec[(c) * o->cap_rec + o->n]
        ROW(R_PHY) = phy;
        ROW(R_SIZE) = total;
        ROW(R_QUEUE_ID) = queue_id;
        ROW(R_QUEUE_OFFSET) = be64(at + QUEUE_OFFSET_OFFSET);
        ROW(R_SYS_FLAG) = sys_flag;
        ROW(R_STORE_TIMESTAMP) = be64(buf + born_end);
        ROW(R_PREPARED_OFFSET) = be64(buf + store_end + PREPARED_OFFSET_AFTER_STORE_HOST);
        ROW(R_TAGS_CODE) = tags_at >= 0 ? (int32_t)java_hash_utf8(buf + tags_at, tags_len, 0) : 0;
        ROW(R_TOPIC_ID) = tid;
        ROW(R_DELAY_AT) = delay_at;
        ROW(R_DELAY_LEN) = delay_len;
        ROW(R_UNIQ_AT) = -1;
        ROW(R_UNIQ_LEN) = 0;
        ROW(R_KEYS_AT) = -1;
        ROW(R_KEYS_LEN) = 0;
        ROW(R_MULTI) = multi_state;
        uint32_t prefix = (uint32_t)o->topics[tid * TOPIC_COLUMNS + T_JAVA_PREFIX];
        if (uniq_at >= 0) {
            memcpy(o->text + o->ntext, buf + uniq_at, (size_t)uniq_len);
            ROW(R_UNIQ_AT) = o->ntext;
            ROW(R_UNIQ_LEN) = uniq_len;
            o->ntext += uniq_len;
            o->keys[K_HASH * o->cap_keys + o->nkeys] = index_key_hash(java_hash_utf8(buf + uniq_at, uniq_len, prefix));
            o->keys[K_OWNER * o->cap_keys + o->nkeys++] = o->n;
        }
        if (keys_at >= 0) {
            memcpy(o->text + o->ntext, buf + keys_at, (size_t)keys_len);
            ROW(R_KEYS_AT) = o->ntext;
            ROW(R_KEYS_LEN) = keys_len;
            o->ntext += keys_len;
            int64_t keys_end = keys_at + keys_len;
            for (int64_t t = keys_at; t < keys_end;) {
                const uint8_t *sp = memchr(buf + t, KEY_SEPARATOR, (size_t)(keys_end - t));
                int64_t e = sp ? sp - buf : keys_end;
                if (e > t) {
                    o->keys[K_HASH * o->cap_keys + o->nkeys] = index_key_hash(java_hash_utf8(buf + t, e - t, prefix));
                    o->keys[K_OWNER * o->cap_keys + o->nkeys++] = o->n;
                }
                t = e + 1;
            }
        }
        if (catalog) {
            ROW(R_BORN_TIMESTAMP) = be64(at + BORN_TIMESTAMP_OFFSET);
            ROW(R_BODY_AT) = body_at;
            ROW(R_BODY_LEN) = body_len;
            const int64_t spans[4][3] = {{R_TAGS_AT, tags_at, tags_len}, {R_REAL_TOPIC_AT, real_topic_at, real_topic_len},
                                         {R_REAL_QID_AT, real_qid_at, real_qid_len}, {R_HOST_AT, host_at, host_len}};
            for (int k = 0; k < 4; k++) {  /* each *_AT column is followed by its *_LEN */
                ROW(spans[k][0]) = spans[k][1] < 0 ? -1 : o->ntext;
                ROW(spans[k][0] + 1) = spans[k][2];
                if (spans[k][1] >= 0) {
                    memcpy(o->text + o->ntext, buf + spans[k][1], (size_t)spans[k][2]);
                    o->ntext += spans[k][2];
                }
            }
        }
#undef ROW
        o->n++;
        pos = end;
        entry = pos;
    }
done:
#undef FAIL
    r.pos = entry;
    return r;
}

/* A writable int64 (or byte) buffer argument, with its length in elements. */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes is not a whole number of items", what, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_decode_window(PyObject *self, PyObject *args) {
    PyObject *image_obj, *rec_obj, *keys_obj, *text_obj, *topics_obj, *table_obj, *multi_obj, *state_obj;
    long long start, stop_at, file_size, base, max_size, multi_flags;
    int check_crc;
    if (!PyArg_ParseTuple(args, "OLLLLLpLOOOOOOO", &image_obj, &start, &stop_at, &file_size, &base, &max_size,
                          &check_crc, &multi_flags, &rec_obj, &keys_obj, &text_obj, &topics_obj, &table_obj,
                          &multi_obj, &state_obj))
        return NULL;
    enum { NBUF = 8 };
    Py_buffer v[NBUF];
    PyObject *objs[NBUF] = {image_obj, rec_obj, keys_obj, text_obj, topics_obj, table_obj, multi_obj, state_obj};
    const Py_ssize_t sizes[NBUF] = {1, 8, 8, 1, 8, 8, 8, 8};
    const char *names[NBUF] = {"image", "records", "keys", "text", "topics", "table", "multi", "state"};
    int got = 0;
    for (; got < NBUF; got++)
        if (get_buffer(objs[got], &v[got], got > 0, sizes[got], names[got]) < 0) goto fail;
    int64_t *state = v[7].buf;
    if (v[7].len < (Py_ssize_t)(STATE_COLUMNS * sizeof(int64_t))) {
        PyErr_Format(PyExc_ValueError, "state: needs %d counters", STATE_COLUMNS);
        goto fail;
    }
    if (start < 0 || file_size > v[0].len || start > file_size || stop_at > file_size) {
        PyErr_Format(PyExc_ValueError, "window [%lld, %lld) of a %lld-byte segment does not fit a %zd-byte image",
                     start, stop_at, file_size, v[0].len);
        goto fail;
    }
    Py_ssize_t table_size = v[5].len / 8;
    if (table_size < 2 || (table_size & (table_size - 1))) {
        PyErr_SetString(PyExc_ValueError, "table: size must be a power of two");
        goto fail;
    }
    Out o = {
        .buf = v[0].buf, .rec = v[1].buf, .keys = v[2].buf, .text = v[3].buf, .topics = v[4].buf,
        .table = v[5].buf, .multi = v[6].buf, .cap_rec = v[1].len / (8 * RECORD_COLUMNS),
        .cap_keys = v[2].len / (8 * KEY_COLUMNS), .cap_text = v[3].len, .cap_topics = v[4].len / (8 * TOPIC_COLUMNS),
        .table_size = table_size, .cap_multi = v[6].len / (8 * MULTI_COLUMNS),
        .n = state[S_RECORDS], .nkeys = state[S_KEYS], .ntext = state[S_TEXT], .ntopics = state[S_TOPICS],
        .nmulti = state[S_MULTI],
    };
    if (o.n < 0 || o.nkeys < 0 || o.ntext < 0 || o.ntopics < 0 || o.nmulti < 0 || o.n > o.cap_rec
        || o.nkeys > o.cap_keys || o.ntext > o.cap_text || o.ntopics > o.cap_topics || o.nmulti > o.cap_multi
        || 2 * o.ntopics > table_size) {
        PyErr_SetString(PyExc_ValueError, "state: counters exceed the buffers");
        goto fail;
    }
    Result r;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < table_size; s++) o.table[s] = -1;
    for (int64_t t = 0; t < o.ntopics; t++) table_insert(&o, t);
    r = decode(&o, start, stop_at, file_size, base, max_size, check_crc, multi_flags);
    Py_END_ALLOW_THREADS
    state[S_RECORDS] = o.n;
    state[S_KEYS] = o.nkeys;
    state[S_TEXT] = o.ntext;
    state[S_TOPICS] = o.ntopics;
    state[S_MULTI] = o.nmulti;
    for (int i = 0; i < NBUF; i++) PyBuffer_Release(&v[i]);
    return Py_BuildValue("(LLLLLL)", (long long)r.stop, (long long)r.pos, (long long)r.err, (long long)r.e1,
                         (long long)r.e2, (long long)r.e3);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

static PyObject *py_put_keys(PyObject *self, PyObject *args) {
    PyObject *file_obj, *hash_obj, *phy_obj, *ts_obj;
    long long entries_at, slot_num, index_count, index_num, begin_ts, begin_phy, entry_base = 0;
    if (!PyArg_ParseTuple(args, "OLLLLLLOOO|L", &file_obj, &entries_at, &slot_num, &index_count, &index_num,
                          &begin_ts, &begin_phy, &hash_obj, &phy_obj, &ts_obj, &entry_base))
        return NULL;
    Py_buffer v[4];
    PyObject *objs[4] = {file_obj, hash_obj, phy_obj, ts_obj};
    const char *names[4] = {"file", "key_hash", "phy_offset", "store_timestamp"};
    int got = 0;
    for (; got < 4; got++)
        if (get_buffer(objs[got], &v[got], got == 0, got == 0 ? 1 : 8, names[got]) < 0) goto fail;
    Py_ssize_t k = v[1].len / 8;
    if (v[2].len / 8 != k || v[3].len / 8 != k) {
        PyErr_SetString(PyExc_ValueError, "key_hash, phy_offset and store_timestamp differ in length");
        goto fail;
    }
    /* entry_base > 0: `file` holds the header, the slots and a window of entries starting at entry_base */
    long long entries_held = entry_base == 0 ? index_num : index_count + k - entry_base;
    if (slot_num <= 0 || entries_at != INDEX_HEADER_SIZE + HASH_SLOT_SIZE * slot_num || index_count < FIRST_INDEX
        || index_count + k > index_num || entry_base < 0 || entry_base > index_count
        || v[0].len < entries_at + INDEX_ENTRY_SIZE * entries_held) {
        PyErr_SetString(PyExc_ValueError, "put_keys: keys do not fit the IndexFile");
        goto fail;
    }
    const int64_t *hash = v[1].buf, *phy = v[2].buf, *ts = v[3].buf;
    uint8_t *file = v[0].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (hash[i] < 0) {
            PyErr_Format(PyExc_ValueError, "put_keys: negative key hash %lld", (long long)hash[i]);
            goto fail;
        }
    }
    long long started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        if (i + PUT_KEYS_PREFETCH < k)  /* slots are random reads in a table of megabytes */
            __builtin_prefetch(file + INDEX_HEADER_SIZE + HASH_SLOT_SIZE * (hash[i + PUT_KEYS_PREFETCH] % slot_num), 1);
        uint8_t *slot = file + INDEX_HEADER_SIZE + HASH_SLOT_SIZE * (hash[i] % slot_num);
        int64_t prev = be32(slot);
        if (prev <= INVALID_INDEX || prev > index_count) {
            prev = INVALID_INDEX;
            started++;
        }
        int64_t diff = 0;  /* seconds since the file's first entry, clamped to [0, MAX_TIME_DIFF] */
        if (begin_ts > 0 && ts[i] > begin_ts) {
            diff = (int64_t)(((uint64_t)ts[i] - (uint64_t)begin_ts) / MS_PER_SECOND);
            if (diff > MAX_TIME_DIFF) diff = MAX_TIME_DIFF;
        }
        uint8_t *entry = file + entries_at + INDEX_ENTRY_SIZE * (index_count - entry_base);
        put_be(entry, (uint64_t)hash[i], 4);
        put_be(entry + 4, (uint64_t)phy[i], 8);
        put_be(entry + 12, (uint64_t)diff, 4);
        put_be(entry + 16, (uint64_t)prev, 4);
        put_be(slot, (uint64_t)index_count, 4);
        if (index_count <= FIRST_INDEX) {
            begin_phy = phy[i];
            begin_ts = ts[i];
        }
        index_count++;
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 4; i++) PyBuffer_Release(&v[i]);
    return Py_BuildValue("(LLLL)", index_count, started, begin_ts, begin_phy);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

/* The backfill's staged IndexFile keys (daemon/backfill/stage.py KEY_DTYPE): packed little-endian records of
 * hash (int32), physical offset, store time and creator time (int64 each). */
#define KEY_RECORD_SIZE 28
#define KEY_RECORD_PHY 4
#define KEY_RECORD_TS 12
#define KEY_RECORD_CREATOR 20
#define NO_CREATOR (-1)

static inline int64_t le64(const uint8_t *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return (int64_t)v;
}
static inline uint32_t key_record_hash(const uint8_t *rec) {
    return (uint32_t)rec[0] | (uint32_t)rec[1] << 8 | (uint32_t)rec[2] << 16 | (uint32_t)rec[3] << 24;
}
static inline void put_le(uint8_t *b, uint64_t v, int size) {
    for (int i = 0; i < size; i++, v >>= 8) b[i] = (uint8_t)v;
}

/* key_records: a window's IndexFile keys as staged records, in dispatch order: the keys of the records that
 * `selected` keeps, each with its record's physical offset and store time, and as creator time the store time
 * of the record after its owner when it is its owner's last key (the next IndexFile would be created by that
 * record), else its owner's. The last key of the window's last record gets NO_CREATOR (the next window's first
 * record decides it). Returns (keys written, whether the last key's owner is the last record). */
static PyObject *py_key_records(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5])) return NULL;
    Py_buffer v[6];
    const Py_ssize_t sizes[6] = {KEY_RECORD_SIZE, 8, 8, 1, 8, 8};
    const char *names[6] = {"out", "key_hash", "key_owner", "selected", "phy_offset", "store_timestamp"};
    int got = 0;
    for (; got < 6; got++)
        if (get_buffer(objs[got], &v[got], got == 0, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t k = v[1].len / 8, n = v[3].len;
    if (v[2].len / 8 != k || v[4].len / 8 != n || v[5].len / 8 != n || v[0].len / KEY_RECORD_SIZE < k) {
        PyErr_SetString(PyExc_ValueError, "key_records: columns differ in length or out is too small");
        goto fail;
    }
    const int64_t *hash = v[1].buf, *owner = v[2].buf, *phy = v[4].buf, *ts = v[5].buf;
    const uint8_t *selected = v[3].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (owner[i] < 0 || owner[i] >= n) {
            PyErr_Format(PyExc_ValueError, "key_records: key %zd's owner %lld is not a record", i, (long long)owner[i]);
            goto fail;
        }
    }
    uint8_t *out = v[0].buf;
    Py_ssize_t w = 0;
    int64_t last_owner = -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t r = owner[i];
        if (!selected[r]) continue;
        int last_of_owner = i + 1 == k || owner[i + 1] != r;
        int64_t creator = !last_of_owner ? ts[r] : r + 1 < n ? ts[r + 1] : NO_CREATOR;
        uint8_t *rec = out + KEY_RECORD_SIZE * w++;
        put_le(rec, (uint64_t)hash[i], 4);
        put_le(rec + KEY_RECORD_PHY, (uint64_t)phy[r], 8);
        put_le(rec + KEY_RECORD_TS, (uint64_t)ts[r], 8);
        put_le(rec + KEY_RECORD_CREATOR, (uint64_t)creator, 8);
        last_owner = r;
    }
    for (int i = 0; i < 6; i++) PyBuffer_Release(&v[i]);
    return Py_BuildValue("(nO)", w, last_owner == n - 1 ? Py_True : Py_False);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

/* put_key_records: put_keys for a chunk of an IndexFile's keys (the backfill's, writers.py): the keys come as
 * staged records, the slots are the chunk's own table (native int32, empty at the chunk's start) apart from the
 * entries, and entry n is written at entries + 20 * (n - index_count at the call) for the caller to write
 * into the file. Each key whose slot was empty in the chunk's table (its entry's previous one, if any, lies in
 * an earlier chunk) is recorded: its entry in first_entry[m], its slot in first_slot[m], m from `firsts` on.
 * A slot is recorded once (its table entry then holds an entry of the chunk), so the chunk needs room for
 * min(its keys, slot_num) of them; `firsts` is the number its table holds already.
 * Returns (index_count, firsts, begin_timestamp, begin_phy_offset). */
static PyObject *py_put_key_records(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    long long index_count, index_num, begin_ts, begin_phy, firsts;
    if (!PyArg_ParseTuple(args, "OOOLLLLOOL", &objs[0], &objs[1], &objs[2], &index_count, &index_num, &begin_ts,
                          &begin_phy, &objs[3], &objs[4], &firsts))
        return NULL;
    Py_buffer v[5];
    const Py_ssize_t sizes[5] = {4, 1, KEY_RECORD_SIZE, 4, 4};
    const char *names[5] = {"slots", "entries", "records", "first_entry", "first_slot"};
    int got = 0;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &v[got], got != 2, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t slot_num = v[0].len / 4, k = v[2].len / KEY_RECORD_SIZE;
    if (slot_num <= 0 || slot_num > INT32_MAX || index_count < FIRST_INDEX || index_count + k > index_num
        || index_num > INT32_MAX
        || v[1].len < INDEX_ENTRY_SIZE * k || firsts < 0 || firsts > slot_num || v[3].len != v[4].len
        || v[3].len / 4 < firsts + (k < slot_num - firsts ? k : slot_num - firsts)) {
        PyErr_SetString(PyExc_ValueError, "put_key_records: keys do not fit the IndexFile or the outputs");
        goto fail;
    }
    int32_t *slots = v[0].buf, *first_entry = v[3].buf, *first_slot = v[4].buf;
    const Py_ssize_t firsts_room = v[3].len / 4;
    int overflow = 0;  /* more empty slots than `firsts` said: a table that does not match it */
    const uint8_t *rec = v[2].buf;
    uint8_t *entry = v[1].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (rec[KEY_RECORD_SIZE * i + 3] & 0x80) {  /* the int32 hash's sign bit */
            PyErr_Format(PyExc_ValueError, "put_key_records: negative key hash in record %zd", i);
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    /* each key's slot is computed once, PUT_KEYS_PREFETCH keys ahead, where it is prefetched (32-bit modulo:
     * hashes are int32 >= 0) */
    uint32_t ahead[PUT_KEYS_PREFETCH];
    for (Py_ssize_t i = 0; i < k && i < PUT_KEYS_PREFETCH; i++)
        ahead[i] = key_record_hash(rec + KEY_RECORD_SIZE * i) % (uint32_t)slot_num;
    for (Py_ssize_t i = 0; i < k; i++, rec += KEY_RECORD_SIZE, entry += INDEX_ENTRY_SIZE) {
        uint32_t slot_no = ahead[i % PUT_KEYS_PREFETCH];
        if (i + PUT_KEYS_PREFETCH < k) {
            uint32_t next = key_record_hash(rec + KEY_RECORD_SIZE * PUT_KEYS_PREFETCH) % (uint32_t)slot_num;
            ahead[i % PUT_KEYS_PREFETCH] = next;
            __builtin_prefetch(slots + next, 1);
        }
        int64_t hash = key_record_hash(rec);
        int64_t phy = le64(rec + KEY_RECORD_PHY), ts = le64(rec + KEY_RECORD_TS);
        int32_t *slot = slots + slot_no;
        int64_t prev = *slot;
        if (prev <= INVALID_INDEX || prev > index_count) {
            if (firsts == firsts_room) {
                overflow = 1;
                break;
            }
            prev = INVALID_INDEX;
            first_entry[firsts] = (int32_t)index_count;
            first_slot[firsts++] = (int32_t)slot_no;
        }
        int64_t diff = 0;  /* as put_keys */
        if (begin_ts > 0 && ts > begin_ts) {
            diff = (int64_t)(((uint64_t)ts - (uint64_t)begin_ts) / MS_PER_SECOND);
            if (diff > MAX_TIME_DIFF) diff = MAX_TIME_DIFF;
        }
        put_be(entry, (uint64_t)hash, 4);
        put_be(entry + 4, (uint64_t)phy, 8);
        put_be(entry + 12, (uint64_t)diff, 4);
        put_be(entry + 16, (uint64_t)prev, 4);
        *slot = (int32_t)index_count;
        if (index_count <= FIRST_INDEX) {
            begin_phy = phy;
            begin_ts = ts;
        }
        index_count++;
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 5; i++) PyBuffer_Release(&v[i]);
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "put_key_records: more slots empty than `firsts` says; first_entry is full");
        return NULL;
    }
    return Py_BuildValue("(LLLL)", index_count, firsts, begin_ts, begin_phy);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

/* link_chains: a chunk's part in assembling an IndexFile from chunks (writers.assemble_index_file). `last`
 * holds, per slot, the last entry of the chunks before it (native int32, 0: none). For each slot the chunk
 * used, its first entry there gets that as its previous entry (big-endian, in the mapped file at entries_at),
 * then `last` takes the chunk's last entry there. */
static PyObject *py_link_chains(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    long long entries_at, index_num;
    if (!PyArg_ParseTuple(args, "OLLOOOO", &objs[0], &entries_at, &index_num, &objs[1], &objs[2], &objs[3],
                          &objs[4]))
        return NULL;
    Py_buffer v[5];
    const Py_ssize_t sizes[5] = {1, 4, 4, 4, 4};
    const char *names[5] = {"file", "last", "first_entry", "slot", "last_entry"};
    int got = 0;
    for (; got < 5; got++)
        if (get_buffer(objs[got], &v[got], got < 2, sizes[got], names[got]) < 0) goto fail;
    Py_ssize_t slot_num = v[1].len / 4, n = v[2].len / 4;
    const int32_t *first = v[2].buf, *slot = v[3].buf, *end = v[4].buf;
    if (v[3].len != v[2].len || v[4].len != v[2].len || entries_at < 0
        || v[0].len < entries_at + INDEX_ENTRY_SIZE * index_num) {
        PyErr_SetString(PyExc_ValueError, "link_chains: columns differ in length or the file is too small");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (first[i] < FIRST_INDEX || first[i] >= index_num || slot[i] < 0 || slot[i] >= slot_num) {
            PyErr_Format(PyExc_ValueError, "link_chains: chain %zd (entry %d, slot %d) out of bounds", i, first[i],
                         slot[i]);
            goto fail;
        }
    uint8_t *entries = (uint8_t *)v[0].buf + entries_at;
    int32_t *last = v[1].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PUT_KEYS_PREFETCH < n)  /* `last` is a random read in a table of megabytes, as a put's slots */
            __builtin_prefetch(last + slot[i + PUT_KEYS_PREFETCH], 1);
        if (last[slot[i]] != INVALID_INDEX)
            put_be(entries + INDEX_ENTRY_SIZE * (int64_t)first[i] + 16, (uint64_t)last[slot[i]], 4);
        last[slot[i]] = end[i];
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 5; i++) PyBuffer_Release(&v[i]);
    Py_RETURN_NONE;
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

/* group_units: the units of a batch queue by queue, by a counting sort over dense queue keys (0 <= key < K).
 * Record r, when take[r], puts its own unit (key rkey[r], queue offset rqo[r]) and then its targets, the
 * multi rows j with owner[j] == r in order (key mkey[j], queue offset mqo[j]); the sort keeps that order
 * inside a key. Out: each unit packed as it lies in a ConsumeQueue file, its queue offset and its CommitLog
 * end; per key the number of units and a state: 0 none, 1 one streak (consecutive queue offsets, growing
 * ends), 2 broken. `cursor` is scratch of K entries. */
static PyObject *py_group_units(PyObject *self, PyObject *args) {
    enum { TAKE, RKEY, RQO, PHY, SIZE, TAGS, OWNER, MKEY, MQO, UNITS, QO, ENDS, COUNTS, STATE, CURSOR, NARGS };
    PyObject *objs[NARGS];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOO", &objs[TAKE], &objs[RKEY], &objs[RQO], &objs[PHY], &objs[SIZE],
                          &objs[TAGS], &objs[OWNER], &objs[MKEY], &objs[MQO], &objs[UNITS], &objs[QO], &objs[ENDS],
                          &objs[COUNTS], &objs[STATE], &objs[CURSOR]))
        return NULL;
    static const Py_ssize_t sizes[NARGS] = {1, 8, 8, 8, 8, 8, 8, 8, 8, 1, 8, 8, 8, 1, 8};
    static const char *names[NARGS] = {"take", "rkey", "rqo", "phy", "size", "tags", "owner", "mkey", "mqo",
                                       "units", "qo", "ends", "counts", "state", "cursor"};
    Py_buffer v[NARGS];
    int got = 0;
    for (; got < NARGS; got++)
        if (get_buffer(objs[got], &v[got], got >= UNITS, sizes[got], names[got]) < 0) goto fail;
    const Py_ssize_t n = v[TAKE].len, m = v[OWNER].len / 8, k = v[COUNTS].len / 8;
    const uint8_t *take = v[TAKE].buf;
    const int64_t *rkey = v[RKEY].buf, *rqo = v[RQO].buf, *phy = v[PHY].buf, *size = v[SIZE].buf, *tags = v[TAGS].buf;
    const int64_t *owner = v[OWNER].buf, *mkey = v[MKEY].buf, *mqo = v[MQO].buf;
    int64_t *qo = v[QO].buf, *ends = v[ENDS].buf, *counts = v[COUNTS].buf, *cursor = v[CURSOR].buf;
    uint8_t *units = v[UNITS].buf, *state = v[STATE].buf;
    if (v[RKEY].len / 8 != n || v[RQO].len / 8 != n || v[PHY].len / 8 != n || v[SIZE].len / 8 != n
        || v[TAGS].len / 8 != n || v[MKEY].len / 8 != m || v[MQO].len / 8 != m || v[STATE].len != k
        || v[CURSOR].len / 8 != k) {
        PyErr_SetString(PyExc_ValueError, "group_units: column lengths differ");
        goto fail;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (!take[r]) continue;
        if (rkey[r] < 0 || rkey[r] >= k) { PyErr_SetString(PyExc_ValueError, "group_units: key out of range"); goto fail; }
        total++;
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        if (owner[j] < 0 || owner[j] >= n || (j && owner[j] < owner[j - 1]) || mkey[j] < 0 || mkey[j] >= k) {
            PyErr_SetString(PyExc_ValueError, "group_units: multi rows out of range or out of record order");
            goto fail;
        }
        total += take[owner[j]] != 0;
    }
    if (v[UNITS].len != total * CQ_UNIT_SIZE || v[QO].len / 8 != total || v[ENDS].len / 8 != total) {
        PyErr_SetString(PyExc_ValueError, "group_units: output buffers do not hold the units");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    memset(counts, 0, (size_t)k * 8);
    memset(state, 0, (size_t)k);
    for (Py_ssize_t r = 0; r < n; r++) counts[rkey[r]] += take[r] != 0;
    for (Py_ssize_t j = 0; j < m; j++) counts[mkey[j]] += take[owner[j]] != 0;
    int64_t at = 0;
    for (Py_ssize_t i = 0; i < k; i++) { cursor[i] = at; at += counts[i]; }
    Py_ssize_t j = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        Py_ssize_t last = j;
        while (last < m && owner[last] == r) last++;
        if (take[r]) {
            for (Py_ssize_t t = j - 1; t < last; t++) {  /* t == j - 1: the record's own unit */
                int64_t key = t < j ? rkey[r] : mkey[t], q = t < j ? rqo[r] : mqo[t], end = phy[r] + size[r];
                int64_t pos = cursor[key]++;
                uint8_t *u = units + pos * CQ_UNIT_SIZE;
                put_be(u, (uint64_t)phy[r], 8);
                put_be(u + 8, (uint64_t)size[r], 4);
                put_be(u + 12, (uint64_t)tags[r], 8);
                qo[pos] = q;
                ends[pos] = end;
                if (state[key] == 0) state[key] = 1;
                else if (q != qo[pos - 1] + 1 || end <= ends[pos - 1]) state[key] = 2;
            }
        }
        j = last;
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < NARGS; i++) PyBuffer_Release(&v[i]);
    return PyLong_FromSsize_t(total);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    Py_buffer b;
    int folded = 1;
    if (!PyArg_ParseTuple(args, "y*|p", &b, &folded)) return NULL;
    uint32_t out;
#ifdef HAVE_CLMUL_CRC
    if (folded && clmul_crc_enabled && b.len >= CLMUL_CRC_MIN_LENGTH) out = crc32_clmul(0, b.buf, (size_t)b.len);
    else
#endif
    out = (uint32_t)crc32(0L, b.buf, (uInt)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(out);
}

/* known_names: for each (at, length) pair, the value `names` holds for the bytes image[at:at+length], or None:
 * a window's topics looked up in the names already checked in one call (a window of 2,000 topics spent a
 * microsecond a name in Python). */
static PyObject *py_known_names(PyObject *self, PyObject *args) {
    PyObject *image_obj, *at_obj, *len_obj, *names;
    if (!PyArg_ParseTuple(args, "OOOO!", &image_obj, &at_obj, &len_obj, &PyDict_Type, &names)) return NULL;
    Py_buffer v[3];
    PyObject *objs[3] = {image_obj, at_obj, len_obj};
    const Py_ssize_t sizes[3] = {1, 8, 8};
    const char *what[3] = {"image", "at", "length"};
    int got = 0;
    PyObject *out = NULL;
    for (; got < 3; got++)
        if (get_buffer(objs[got], &v[got], 0, sizes[got], what[got]) < 0) goto done;
    const Py_ssize_t n = v[1].len / 8;
    if (v[2].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "known_names: column lengths differ");
        goto done;
    }
    const int64_t *at = v[1].buf, *len = v[2].buf;
    const char *image = v[0].buf;
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || len[i] < 0 || at[i] + len[i] > v[0].len) {
            PyErr_SetString(PyExc_ValueError, "known_names: a name lies outside the image");
            Py_CLEAR(out);
            goto done;
        }
        PyObject *raw = PyBytes_FromStringAndSize(image + at[i], (Py_ssize_t)len[i]);
        if (raw == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyObject *known = PyDict_GetItemWithError(names, raw);
        Py_DECREF(raw);
        if (known == NULL && PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        if (known == NULL) known = Py_None;
        Py_INCREF(known);
        PyList_SET_ITEM(out, i, known);
    }
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return out;
}

static PyObject *py_java_hash_utf8(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned int h = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &h)) return NULL;
    uint32_t out = java_hash_utf8(b.buf, b.len, h);
    PyBuffer_Release(&b);
    return PyLong_FromLong((int32_t)out);
}

/* mkdir -p: create `dir` and any missing parents (mode 0777 before the umask, as os.makedirs) */
static int make_dirs(char *dir) {
    if (mkdir(dir, 0777) == 0 || errno == EEXIST) return 0;
    if (errno != ENOENT) return -1;
    char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir) return -1;
    *slash = '\0';
    int r = make_dirs(dir);
    *slash = '/';
    if (r != 0) return -1;
    return (mkdir(dir, 0777) == 0 || errno == EEXIST) ? 0 : -1;
}

/* create_files' flags of an item (mappedfile.CREATE_MAKE_PARENT, CREATE_KEEP_OPEN) */
enum { MAKE_PARENT = 1, KEEP_OPEN = 2 };
/* what create_files returns for an item instead of a descriptor (mappedfile.CREATE_EXISTED, CREATE_CLOSED) */
enum { EXISTED = -1, CLOSED = -2 };

typedef struct {
    char *dir, *path;
    const char *header;
    Py_ssize_t header_len;
    int flags, fd;
} CreateItem;

/* One file, in place: its directory (and, with MAKE_PARENT, the directory's parent first), then `path` opened
 * O_EXCL, sized (sparse) and its header written: mappedfile.create_in_place's steps. -1 with errno and
 * *failed set to the path the error concerns; a file made here is removed again. */
static int create_one(CreateItem *it, int64_t size, const char **failed) {
    *failed = it->dir;
    if (it->flags & MAKE_PARENT) {
        char *slash = strrchr(it->dir, '/');
        if (slash != NULL && slash != it->dir) {
            *slash = '\0';
            int r = mkdir(it->dir, 0777);
            int e = errno;
            *slash = '/';
            if (r != 0 && e != EEXIST && e != ENOENT) {
                errno = e;
                return -1;
            }
        }
    }
    if (mkdir(it->dir, 0777) != 0 && errno != EEXIST && make_dirs(it->dir) != 0) return -1;
    *failed = it->path;
    int fd = open(it->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        if (errno != EEXIST) return -1;
        it->fd = EXISTED; /* made by someone else since the store was loaded */
        return 0;
    }
    if (ftruncate(fd, (off_t)size) != 0) goto fail;
    for (Py_ssize_t done = 0; done < it->header_len;) {
        ssize_t w = pwrite(fd, it->header + done, (size_t)(it->header_len - done), (off_t)done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            if (w == 0) errno = ENOSPC;
            goto fail;
        }
        done += w;
    }
    if (it->flags & KEEP_OPEN) {
        it->fd = fd;
    } else {
        close(fd);
        it->fd = CLOSED;
    }
    return 0;
fail: {
        int e = errno;
        close(fd);
        unlink(it->path);
        errno = e;
        return -1;
    }
}

/* create_files(items, size): each (directory, path, header, flags) created in place (create_one), in order,
 * with the GIL released once; a list of each one's descriptor (KEEP_OPEN), CLOSED or EXISTED. On an error
 * the descriptors made are closed and OSError raised naming the path; the files made stay, complete. */
static PyObject *py_create_files(PyObject *self, PyObject *args) {
    PyObject *items;
    long long size;
    if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &items, &size)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    CreateItem *it = PyMem_Calloc((size_t)(n ? n : 1), sizeof(CreateItem));
    PyObject **keep = PyMem_Calloc((size_t)(n ? 2 * n : 1), sizeof(PyObject *));
    PyObject *out = NULL;
    if (it == NULL || keep == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dir = NULL, *path = NULL, *header = NULL;
        int flags = 0;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(items, i), "O&O&O!i", PyUnicode_FSConverter, &dir,
                              PyUnicode_FSConverter, &path, &PyBytes_Type, &header, &flags)) {
            Py_XDECREF(dir);
            Py_XDECREF(path);
            goto done;
        }
        keep[2 * i] = dir;
        keep[2 * i + 1] = path;
        it[i].dir = PyBytes_AS_STRING(dir);
        it[i].path = PyBytes_AS_STRING(path);
        it[i].header = PyBytes_AS_STRING(header); /* `items` holds the header for the call */
        it[i].header_len = PyBytes_GET_SIZE(header);
        it[i].flags = flags;
        it[i].fd = EXISTED;
    }
    Py_ssize_t made = 0;
    int err = 0;
    const char *failed = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (; made < n; made++) {
        if (create_one(&it[made], (int64_t)size, &failed) != 0) {
            err = errno;
            break;
        }
    }
    if (err != 0)
        for (Py_ssize_t i = 0; i < made; i++)
            if (it[i].fd >= 0) close(it[i].fd);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        PyObject *name = PyUnicode_DecodeFSDefault(failed);
        if (name != NULL) {
            errno = err;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
            Py_DECREF(name);
        }
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (it[i].fd >= 0) close(it[i].fd);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(it[i].fd));
done:
    if (keep != NULL)
        for (Py_ssize_t i = 0; i < 2 * n; i++) Py_XDECREF(keep[i]);
    PyMem_Free(keep);
    PyMem_Free(it);
    return out;
}

/* pwrite_many: every (fd, data, position) written in full, in order, with the GIL released once; data is one
 * buffer or a list of buffers written back to back (pwritev). A write may be (-1, data, position, path): the file
 * is opened for it (O_WRONLY) and closed again, which a write to one of a hundred thousand queues that no
 * descriptor set holds open asks for. Returns None, or (index, bytes left, position reached, errno) of the first
 * write that failed. */
static PyObject *py_pwrite_many(PyObject *self, PyObject *args) {
    PyObject *writes;
    int dirfd = -1;
    Py_buffer under = {0};
    if (!PyArg_ParseTuple(args, "O!|iy*", &PyList_Type, &writes, &dirfd, &under)) return NULL;
    const char *prefix = under.buf != NULL ? under.buf : "";
    size_t prefix_len = under.buf != NULL ? (size_t)under.len : 0;
    Py_ssize_t n = PyList_GET_SIZE(writes), nbufs = 0, got = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(writes, i);
        if (!PyTuple_Check(w) || (PyTuple_GET_SIZE(w) != 3 && PyTuple_GET_SIZE(w) != 4)) {
            PyErr_SetString(PyExc_TypeError, "pwrite_many: each write is (fd, data, position[, path])");
            return NULL;
        }
        PyObject *data = PyTuple_GET_ITEM(w, 1);
        nbufs += PyList_Check(data) ? PyList_GET_SIZE(data) : 1;
    }
    Py_buffer *bufs = PyMem_Calloc((size_t)(nbufs ? nbufs : 1), sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)(nbufs ? nbufs : 1), sizeof(struct iovec));
    Py_ssize_t *first = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    int *fds = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int));
    long long *pos = PyMem_Calloc((size_t)(n ? n : 1), sizeof(long long));
    PyObject **paths = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    PyObject *out = NULL;
    if (bufs == NULL || iov == NULL || first == NULL || fds == NULL || pos == NULL || paths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(writes, i), *data = PyTuple_GET_ITEM(w, 1);
        first[i] = got;
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(w, 0));
        pos[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(w, 2));
        if (PyErr_Occurred()) goto done;
        if (fd < 0 && PyTuple_GET_SIZE(w) == 4) {
            if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(w, 3), &paths[i])) goto done;
        } else if (fd < 0 || fd > INT_MAX) {
            PyErr_SetString(PyExc_ValueError, "pwrite_many: not a descriptor");
            goto done;
        }
        fds[i] = (int)fd;
        Py_ssize_t parts = PyList_Check(data) ? PyList_GET_SIZE(data) : 1;
        for (Py_ssize_t k = 0; k < parts; k++, got++) {
            if (PyObject_GetBuffer(PyList_Check(data) ? PyList_GET_ITEM(data, k) : data, &bufs[got],
                                   PyBUF_C_CONTIGUOUS) < 0) goto done;
            iov[got].iov_base = bufs[got].buf;
            iov[got].iov_len = (size_t)bufs[got].len;
        }
    }
    first[n] = got;
    Py_ssize_t failed = -1, left = 0;
    long long at = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && failed < 0; i++) {
        struct iovec *v = iov + first[i];
        int count = (int)(first[i + 1] - first[i]);
        left = 0;
        for (int k = 0; k < count; k++) left += (Py_ssize_t)v[k].iov_len;
        at = pos[i];
        int fd = fds[i];
        if (fd < 0) {
            const char *path = PyBytes_AS_STRING(paths[i]);
            /* a path under the directory `dirfd` is opened relative to it: the kernel walks three names, not the
             * whole path (its lookups were a third of the open's time over 10,000 queues) */
            if (dirfd >= 0 && prefix_len > 0 && strncmp(path, prefix, prefix_len) == 0 && path[prefix_len] == '/')
                fd = openat(dirfd, path + prefix_len + 1, O_WRONLY | O_CLOEXEC);
            else
                fd = open(path, O_WRONLY | O_CLOEXEC);
            if (fd < 0) {
                err = errno;
                failed = i;
                break;
            }
        }
        while (left > 0) {
            while (count > 0 && v->iov_len == 0) { v++; count--; }
            ssize_t w = pwritev(fd, v, count < IOV_MAX ? count : IOV_MAX, (off_t)at);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                err = w == 0 ? ENOSPC : errno;
                failed = i;
                break;
            }
            left -= w;
            at += w;
            while (w > 0) {  /* past what was written: whole buffers, then into the next one */
                size_t step = (size_t)w < v->iov_len ? (size_t)w : v->iov_len;
                v->iov_base = (char *)v->iov_base + step;
                v->iov_len -= step;
                w -= (ssize_t)step;
                if (v->iov_len == 0 && w > 0) { v++; count--; }
            }
        }
        if (fds[i] < 0) close(fd);
    }
    Py_END_ALLOW_THREADS
    out = failed < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nnLi)", failed, left, at, err);
done:
    if (under.buf != NULL) PyBuffer_Release(&under);
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    if (paths != NULL)
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(paths[i]);
    PyMem_Free(bufs);
    PyMem_Free(iov);
    PyMem_Free(first);
    PyMem_Free(fds);
    PyMem_Free(pos);
    PyMem_Free(paths);
    return out;
}

/* gather_pieces(sources, which, lo, hi, out): sources[which[i]][lo[i]:hi[i]] (byte offsets) for every i, copied
 * back to back into `out` (which must hold exactly their sum), with the GIL released for the copies. A queue's
 * gathered appends are many small slices of the batches they came in (one unit each over 10,000 queues): made
 * into views and handed to pwritev one by one they cost some 1 us of Python each. */
static PyObject *py_gather_pieces(PyObject *self, PyObject *args) {
    PyObject *sources, *objs[4];
    if (!PyArg_ParseTuple(args, "O!OOOO", &PyList_Type, &sources, &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    Py_ssize_t nsrc = PyList_GET_SIZE(sources);
    Py_buffer v[4];
    Py_buffer *src = PyMem_Calloc((size_t)(nsrc ? nsrc : 1), sizeof(Py_buffer));
    const char *names[4] = {"which", "lo", "hi", "out"};
    int got = 0;
    Py_ssize_t gotsrc = 0;
    PyObject *result = NULL;
    if (src == NULL) return PyErr_NoMemory();
    for (; got < 4; got++)
        if (get_buffer(objs[got], &v[got], got == 3, got == 3 ? 1 : 8, names[got]) < 0) goto done;
    for (; gotsrc < nsrc; gotsrc++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(sources, gotsrc), &src[gotsrc], PyBUF_C_CONTIGUOUS) < 0) goto done;
    Py_ssize_t n = v[0].len / 8;
    if (v[1].len / 8 != n || v[2].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "gather_pieces: which, lo and hi differ in length");
        goto done;
    }
    const int64_t *which = v[0].buf, *lo = v[1].buf, *hi = v[2].buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (which[i] < 0 || which[i] >= nsrc || lo[i] < 0 || hi[i] < lo[i] || hi[i] > src[which[i]].len) {
            PyErr_Format(PyExc_ValueError, "gather_pieces: piece %zd [%lld, %lld) of source %lld is out of range",
                         i, (long long)lo[i], (long long)hi[i], (long long)which[i]);
            goto done;
        }
        total += (Py_ssize_t)(hi[i] - lo[i]);
    }
    if (total != v[3].len) {
        PyErr_Format(PyExc_ValueError, "gather_pieces: the pieces hold %zd bytes, out %zd", total, v[3].len);
        goto done;
    }
    char *out = v[3].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t len = (size_t)(hi[i] - lo[i]);
        memcpy(out, (const char *)src[which[i]].buf + lo[i], len);
        out += len;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < gotsrc; i++) PyBuffer_Release(&src[i]);
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    PyMem_Free(src);
    return result;
}

static PyObject *py_syncfs(PyObject *self, PyObject *args) {
    int fd, r;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    r = syncfs(fd);
    Py_END_ALLOW_THREADS
    if (r != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_window", py_decode_window, METH_VARARGS,
     "decode_window(image, start, stop_at, file_size, base, max_size, check_crc, multi_flags, records, keys, "
     "text, topics, table, multi, state) -> (stop, position, error, e1, e2, e3)"},
    {"put_keys", py_put_keys, METH_VARARGS,
     "put_keys(file, entries_at, hash_slot_num, index_count, index_num, begin_timestamp, begin_phy_offset, "
     "key_hash, phy_offset, store_timestamp, entry_base=0) -> (index_count, chains_started, begin_timestamp, "
     "begin_phy_offset); with entry_base, entry n is written at entries_at + 20 * (n - entry_base)"},
    {"key_records", py_key_records, METH_VARARGS,
     "key_records(out, key_hash, key_owner, selected, phy_offset, store_timestamp) -> (keys, last_owner_is_last)"},
    {"put_key_records", py_put_key_records, METH_VARARGS,
     "put_key_records(slots, entries, records, index_count, index_num, begin_timestamp, begin_phy_offset, "
     "first_entry, first_slot, firsts) -> (index_count, firsts, begin_timestamp, begin_phy_offset)"},
    {"link_chains", py_link_chains, METH_VARARGS,
     "link_chains(file, entries_at, index_num, last, first_entry, slot, last_entry) -> None"},
    {"group_units", py_group_units, METH_VARARGS,
     "group_units(take, rkey, rqo, phy, size, tags, owner, mkey, mqo, units, qo, ends, counts, state, cursor) "
     "-> units"},
    {"crc32", py_crc32, METH_VARARGS,
     "crc32(data, folded=True) -> the body CRC path's crc32 of data (folded=False: zlib's, for comparison)"},
    {"known_names", py_known_names, METH_VARARGS,
     "known_names(image, at, length, names): per name image[at:at+length], the value names holds for its bytes, "
     "or None"},
    {"java_hash_utf8", py_java_hash_utf8, METH_VARARGS,
     "java_hash_utf8(data, h=0) -> String.hashCode of the UTF-8 data decoded as Java decodes it"},
    {"create_files", py_create_files, METH_VARARGS,
     "create_files([(directory, path, header, flags), ...], size) -> a read-write descriptor (KEEP_OPEN), "
     "CLOSED, or EXISTED (the path existed already) for each; on an error every descriptor made is closed and "
     "OSError names the path"},
    {"pwrite_many", py_pwrite_many, METH_VARARGS,
     "pwrite_many([(fd, data, position[, path]), ...], dirfd=-1, under=b'') -> None, or (index, bytes left, "
     "position, errno) of the first write that failed; data is a buffer or a list of buffers written back to back; "
     "fd -1 with a path: the file is opened for the write and closed (relative to dirfd when the path is under the "
     "directory `under` it is open on)"},
    {"gather_pieces", py_gather_pieces, METH_VARARGS,
     "gather_pieces(sources, which, lo, hi, out) -> None: sources[which[i]][lo[i]:hi[i]] (bytes) copied back to "
     "back into out, which holds exactly their sum"},
    {"syncfs", py_syncfs, METH_VARARGS, "syncfs(fd): sync the whole file system holding fd"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "indexcore._kernels", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#ifdef HAVE_CLMUL_CRC
    __builtin_cpu_init();
    clmul_crc_enabled = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    if (PyModule_AddIntConstant(m, "FOLDED_CRC", CLMUL_ENABLED_VALUE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    const struct { const char *name; long value; } constants[] = {
        {"MAGIC_CODE_OFFSET", MAGIC_CODE_OFFSET}, {"BODY_CRC_OFFSET", BODY_CRC_OFFSET},
        {"QUEUE_ID_OFFSET", QUEUE_ID_OFFSET}, {"QUEUE_OFFSET_OFFSET", QUEUE_OFFSET_OFFSET},
        {"PHYSICAL_OFFSET_OFFSET", PHYSICAL_OFFSET_OFFSET}, {"SYS_FLAG_OFFSET", SYS_FLAG_OFFSET},
        {"BORN_HOST_OFFSET", BORN_HOST_OFFSET}, {"HOST_V4_LENGTH", HOST_V4_LENGTH},
        {"HOST_V6_LENGTH", HOST_V6_LENGTH}, {"MIN_RECORD_SIZE", MIN_RECORD_SIZE},
        {"END_FILE_MIN_BLANK_LENGTH", END_FILE_MIN_BLANK_LENGTH}, {"MESSAGE_MAGIC_CODE", MESSAGE_MAGIC_CODE},
        {"MESSAGE_MAGIC_CODE_V2", MESSAGE_MAGIC_CODE_V2}, {"BLANK_MAGIC_CODE", BLANK_MAGIC_CODE},
        {"BORNHOST_V6_FLAG", BORNHOST_V6_FLAG}, {"STOREHOSTADDRESS_V6_FLAG", STOREHOSTADDRESS_V6_FLAG},
        {"INDEX_HEADER_SIZE", INDEX_HEADER_SIZE}, {"HASH_SLOT_SIZE", HASH_SLOT_SIZE},
        {"INDEX_ENTRY_SIZE", INDEX_ENTRY_SIZE}, {"MAX_TIME_DIFF", (long)MAX_TIME_DIFF},
        {"STOP_LIMIT", STOP_LIMIT}, {"STOP_BLANK", STOP_BLANK}, {"STOP_END", STOP_END},
        {"STOP_ERROR", STOP_ERROR}, {"STOP_FULL", STOP_FULL},
        {"FULL_RECORDS", FULL_RECORDS}, {"FULL_KEYS", FULL_KEYS}, {"FULL_TEXT", FULL_TEXT},
        {"FULL_TOPICS", FULL_TOPICS}, {"FULL_TABLE", FULL_TABLE}, {"FULL_MULTI", FULL_MULTI},
        {"ERR_NO_BLANK", ERR_NO_BLANK}, {"ERR_PARTS", ERR_PARTS}, {"ERR_FIXED_PART", ERR_FIXED_PART},
        {"ERR_MULTI_NO_PROPERTIES", ERR_MULTI_NO_PROPERTIES}, {"ERR_MULTI_QUEUE_OFFSET", ERR_MULTI_QUEUE_OFFSET},
        {"OFFSET_NOT_A_NUMBER", OFFSET_NOT_A_NUMBER}, {"OFFSET_NEGATIVE", OFFSET_NEGATIVE},
        {"OFFSET_TOO_LARGE", OFFSET_TOO_LARGE}, {"MULTI_DISPATCH", MULTI_DISPATCH},
        {"MULTI_DISPATCH_LMQ", MULTI_DISPATCH_LMQ}, {"DLEDGER_ENTRIES", DLEDGER_ENTRIES},
        {"CATALOG_FIELDS", CATALOG_FIELDS}, {"R_BORN_TIMESTAMP", R_BORN_TIMESTAMP}, {"R_BODY_AT", R_BODY_AT},
        {"R_BODY_LEN", R_BODY_LEN}, {"R_TAGS_AT", R_TAGS_AT}, {"R_TAGS_LEN", R_TAGS_LEN},
        {"R_REAL_TOPIC_AT", R_REAL_TOPIC_AT}, {"R_REAL_TOPIC_LEN", R_REAL_TOPIC_LEN}, {"R_REAL_QID_AT", R_REAL_QID_AT},
        {"R_REAL_QID_LEN", R_REAL_QID_LEN}, {"R_HOST_AT", R_HOST_AT}, {"R_HOST_LEN", R_HOST_LEN},
        {"ERR_ENTRY_NO_BLANK", ERR_ENTRY_NO_BLANK}, {"ERR_ENTRY_BLANK_SIZE", ERR_ENTRY_BLANK_SIZE},
        {"ERR_ENTRY_MAGIC", ERR_ENTRY_MAGIC}, {"ERR_ENTRY_SIZE", ERR_ENTRY_SIZE}, {"ERR_ENTRY_POS", ERR_ENTRY_POS},
        {"ERR_ENTRY_BODY_LENGTH", ERR_ENTRY_BODY_LENGTH}, {"ERR_ENTRY_TOTAL_SIZE", ERR_ENTRY_TOTAL_SIZE},
        {"DLEDGER_HEADER_SIZE", DLEDGER_HEADER_SIZE}, {"MULTI_NONE", MULTI_NONE}, {"MULTI_DISPATCHED", MULTI_DISPATCHED},
        {"MULTI_COUNT_MISMATCH", MULTI_COUNT_MISMATCH}, {"R_MULTI", R_MULTI}, {"M_OWNER", M_OWNER},
        {"M_TOPIC_ID", M_TOPIC_ID}, {"M_QUEUE_ID", M_QUEUE_ID}, {"M_QUEUE_OFFSET", M_QUEUE_OFFSET},
        {"MULTI_COLUMNS", MULTI_COLUMNS}, {"T_ROLE", T_ROLE}, {"ROLE_TOPIC", ROLE_TOPIC},
        {"ROLE_MULTI_DISPATCH", ROLE_MULTI_DISPATCH}, {"CQ_UNIT_SIZE", CQ_UNIT_SIZE},
        {"R_PHY", R_PHY}, {"R_SIZE", R_SIZE}, {"R_QUEUE_ID", R_QUEUE_ID}, {"R_QUEUE_OFFSET", R_QUEUE_OFFSET},
        {"R_SYS_FLAG", R_SYS_FLAG}, {"R_STORE_TIMESTAMP", R_STORE_TIMESTAMP},
        {"R_PREPARED_OFFSET", R_PREPARED_OFFSET}, {"R_TAGS_CODE", R_TAGS_CODE}, {"R_TOPIC_ID", R_TOPIC_ID},
        {"R_KEYS_AT", R_KEYS_AT}, {"R_KEYS_LEN", R_KEYS_LEN}, {"R_UNIQ_AT", R_UNIQ_AT},
        {"R_UNIQ_LEN", R_UNIQ_LEN}, {"R_DELAY_AT", R_DELAY_AT}, {"R_DELAY_LEN", R_DELAY_LEN},
        {"RECORD_COLUMNS", RECORD_COLUMNS}, {"K_HASH", K_HASH}, {"K_OWNER", K_OWNER},
        {"KEY_COLUMNS", KEY_COLUMNS}, {"T_AT", T_AT}, {"T_LEN", T_LEN}, {"T_FIRST", T_FIRST}, {"TOPIC_COLUMNS", TOPIC_COLUMNS},
        {"STATE_COLUMNS", STATE_COLUMNS}, {"MAKE_PARENT", MAKE_PARENT}, {"KEEP_OPEN", KEEP_OPEN},
        {"EXISTED", EXISTED}, {"CLOSED", CLOSED},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
