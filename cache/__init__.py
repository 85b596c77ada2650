"""The KV cache across requests, over a StaticPipeline (issue 15).

    kvc.cache.prefix    PrefixCache: blocks keyed by a hash chained over their tokens, restored
                        into the pipeline's buffers; priority retention and leaf-first eviction
    kvc.cache.events    KV cache events (stored, removed, updated) in a bounded buffer
    kvc.cache.serving   CachedPipeline: generate with the prefix cache and chat sessions
    kvc.cache.requests  the JSONL workload `kvc run --requests` replays
"""
