"""The elastic core: the contract every live mechanism implements and the parts they share.

A live mechanism changes a running server's shape between two batches. Whatever it changes
(layer precision, which layers a replica holds, the tensor-parallel degree), it runs the same
loop, owned here:

    per-step hook (rate-limited) -> observe (a typed snapshot) -> decide (a ``Controller``)
      -> coordinate (only the leader decides: TP rank 0, PP stage 0, a group's leader)
      -> apply (all-or-nothing, between batches) -> record (a ``Transition``)
      -> metrics -> status -> ``check_integrity()``

    contract.py   Outcome, Transition, ElasticError (carries its HTTP status), the Controller
                  and ElasticMechanism protocols
    loop.py       ElasticLoop: the loop above, for one mechanism on one scheduler
    record.py     TransitionRecorder: the recent transitions, the JSONL log and one Prometheus
                  family (labels ``mechanism``, ``replica``) for every mechanism
    control.py    the HTTP process's control client and the typed answer every scheduler sends
    status.py     GET /elastic/status: every enabled mechanism, its state, recent transitions
    registry.py   the mechanisms the plugin knows (one line each) and their common surface

Nothing here imports a mechanism; mechanisms import the core.
"""
