/* Pages added to and dropped from the page cache, every process's files: counted in the
 * kernel per (bucket of DISK_BUCKET_NS, file system device, inode, change), from
 * filemap:mm_filemap_add_to_page_cache and mm_filemap_delete_from_page_cache (a folio
 * of 1 << order pages).
 *
 * - added: every page added (read, readahead, written, faulted in), refaults included.
 * - dropped: every page deleted (reclaim, truncation, invalidation, fadvise DONTNEED).
 * - refaulted: of the added, those at a (device, inode, index) dropped earlier in the
 *   recording.  Dropped pages are counted in an LRU hash of REFAULT_KEYS granules of
 *   1 << REFAULT_SHIFT pages (device, inode, index >> REFAULT_SHIFT), the least recently
 *   dropped forgotten first; a page added to a granule with dropped pages left counts as
 *   a refault and takes one of them.  Granules, not pages: a folio (up to 512 pages) is
 *   matched however the pages were split into folios when dropped and when read back.
 * Nothing here reads kernel structs: only the tracepoints' fields. */
#ifndef PROBE_PAGECACHE
#error "PROBE_PAGECACHE must be defined by the loader"
#endif
#ifndef DISK_BUCKET_NS
#error "DISK_BUCKET_NS must be defined by the loader"
#endif
#ifndef PAGE_CACHE_ENTRIES
#error "PAGE_CACHE_ENTRIES must be defined by the loader"
#endif
#ifndef REFAULT_KEYS
#error "REFAULT_KEYS must be defined by the loader"
#endif
#ifndef REFAULT_SHIFT
#error "REFAULT_SHIFT must be defined by the loader"
#endif
/* The most granules one folio spans: the largest page cache folio >> REFAULT_SHIFT. */
#ifndef REFAULT_SPAN
#error "REFAULT_SPAN must be defined by the loader"
#endif
/* Change codes (tracer/collectors/pagecache.py CHANGES). */
#ifndef PC_ADDED
#error "PC_ADDED must be defined by the loader"
#endif
#ifndef PC_DROPPED
#error "PC_DROPPED must be defined by the loader"
#endif
#ifndef PC_REFAULTED
#error "PC_REFAULTED must be defined by the loader"
#endif

struct page_cache_key {
    u64 bucket;
    u64 ino;
    u32 dev; /* the file system's device, kernel dev_t (major << 20 | minor) */
    u32 change;
};

struct dropped_key {
    u64 ino;
    u64 granule; /* page index >> REFAULT_SHIFT */
    u32 dev;
    u32 pad;
};

BPF_HASH(page_cache_counts, struct page_cache_key, u64, PAGE_CACHE_ENTRIES);
/* granules of dropped pages -> how many of their pages were dropped and not yet back */
BPF_TABLE("lru_hash", struct dropped_key, u32, dropped_pages, REFAULT_KEYS);

static __always_inline void count_pages(u64 bucket, u32 dev, u64 ino, u32 change, u64 pages)
{
    struct page_cache_key key = {.bucket = bucket, .ino = ino, .dev = dev, .change = change};
    u64 zero = 0;
    u64 *n = page_cache_counts.lookup_or_try_init(&key, &zero);
    if (!n) {
        count_lost(PROBE_PAGECACHE);
        return;
    }
    __sync_fetch_and_add(n, pages);
}

/* The pages of a folio of `order` in each granule it covers: all of them in one granule,
 * or whole granules. */
static __always_inline u32 granule_pages(u32 order)
{
    return order < REFAULT_SHIFT ? 1U << order : 1U << REFAULT_SHIFT;
}

static __always_inline u32 granules(u32 order)
{
    return order < REFAULT_SHIFT ? 1 : 1U << (order - REFAULT_SHIFT);
}

TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache)
{
    u64 bucket = bpf_ktime_get_ns() / DISK_BUCKET_NS;
    u32 order = args->order, per = granule_pages(order), span = granules(order);
    struct dropped_key key = {.ino = args->i_ino, .granule = args->index >> REFAULT_SHIFT, .dev = args->s_dev};
    count_pages(bucket, key.dev, key.ino, PC_ADDED, 1ULL << order);
    u64 back = 0;
    for (u32 i = 0; i < REFAULT_SPAN && i < span; i++, key.granule++) {
        u32 *dropped = dropped_pages.lookup(&key);
        if (!dropped)
            continue;
        u32 left = *dropped;
        if (left <= per) {
            back += left;
            dropped_pages.delete(&key);
        } else {
            back += per;
            __sync_fetch_and_add(dropped, -per); /* BPF has no atomic subtract: add its negation */
        }
    }
    if (back)
        count_pages(bucket, key.dev, key.ino, PC_REFAULTED, back);
    return 0;
}

TRACEPOINT_PROBE(filemap, mm_filemap_delete_from_page_cache)
{
    u32 order = args->order, per = granule_pages(order), span = granules(order);
    struct dropped_key key = {.ino = args->i_ino, .granule = args->index >> REFAULT_SHIFT, .dev = args->s_dev};
    count_pages(bpf_ktime_get_ns() / DISK_BUCKET_NS, key.dev, key.ino, PC_DROPPED, 1ULL << order);
    for (u32 i = 0; i < REFAULT_SPAN && i < span; i++, key.granule++) {
        u32 *dropped = dropped_pages.lookup(&key);
        if (dropped) {
            __sync_fetch_and_add(dropped, per);
        } else {
            dropped_pages.update(&key, &per);
        }
    }
    return 0;
}
