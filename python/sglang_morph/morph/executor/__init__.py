"""SGLang-specific executors: small objects that apply morph actions to SGLang's model and

memory objects between forward passes, on the scheduler thread. Imported only inside SGLang
processes (they import SGLang's model classes lazily through the objects they are given).
"""
