"""KunServe on live SGLang data-parallel replicas (``--enable-kunserve --dp-size 2``).

``config`` (flags, launch checks), ``link`` (the pair's link: a two-member
``groups.link.GroupLink``), ``replica`` (one replica's side, a ``groups.member.GroupMember``:
drop, restore, the pipelined forward, the peer's layers), ``hooks`` (the SGLang hooks),
``messages`` and ``http`` (``/kunserve/*``). The design and what is not built yet are in
``replica.py``'s docstring.
"""
