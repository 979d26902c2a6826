"""AMOEBAs: data-parallel replicas merged into one tensor-parallel group at runtime, split back.

    forward.py     the merged group's tensor-parallel forward: each member's heads and FFN
                   rows of an owner's batch, partial sums all-reduced (SGLang's tp_size stays 1)
"""
