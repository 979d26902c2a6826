"""Replica groups: N data-parallel replicas that change shape together (KunServe's pair that
drops complementary layers; AMOEBAs' replicas merged into one tensor-parallel group).

    link.py        GroupLink: gloo process groups between the members (a control group for
                   votes and moved state, one call group per member), bundles of named
                   tensors, the mailbox
    transition.py  voted transitions: every member votes, runs each phase, exchanges the
                   outcome, and undoes completed phases on any failure, so a transition
                   happens on every member or on none; recorded in the elastic core
    attention.py   attention of a batch's new rows over KV read at its slots (a member
                   running another member's batch over its mirror of that member's KV)
    member.py      GroupMember: one replica's side (compute lock, service threads answering
                   the other members' calls, live requests, status, metrics)

Below the mechanisms, above the elastic core: this package imports no mechanism.
"""
