"""AMOEBAs: data-parallel replicas merged into one tensor-parallel group at runtime, split back.

    capacity.py    what a member of a group of degree d keeps and how many KV tokens its own
                   requests may hold (plain integers: the policy and the simulator use it)
    policy.py      the transformation-aware scheduler's decisions (dispatch, merge, wait,
                   refuse, split) and the merge-on-demand baselines, on frozen dataclasses
    config.py      --enable-amoebas: flags, the degrees the model and --dp-size allow, the
                   groups (aligned runs of replicas), launch checks
    forward.py     the merged group's tensor-parallel forward: each member's heads and FFN
                   rows of an owner's batch, partial sums all-reduced (SGLang's tp_size stays 1)
    pages.py       anonymous page mappings released with MADV_DONTNEED; the parallelism-aware
                   padding of the FFN rows (every degree's shard boundary on a page)
    weights.py     FFN weights in place: gate | up | down^T rows per layer in one mapping, a
                   member's shard kept and the rest released, the peers' rows written back
    kv_layout.py   KV by head: each KV head's rows in their own range of an anonymous mapping,
                   seen by SGLang's pool through strided views; the own pool and the mirrors
    kv_reshard.py  re-sharding live KV rows by head between members (merge and split as
                   phases with undo), the paper's token-first base variant beside it
    auto.py        automatic transitions: a prompt no replica holds merges the smallest group
                   that does; a group splits once its long requests are done
    replica.py     one replica's side: its links to the groups it may join, merge and split as
                   voted transitions, the merged forward on its batches and the others'
    messages.py, http.py   /amoebas/status, /amoebas/merge, /amoebas/split
    mechanism.py   the registration with the plugin (flags, hooks, attach, routes)
"""
