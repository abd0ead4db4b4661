"""torch DDP's surface on gradsync's wrapper: what a program written for torch's class finds.

    torch_args.py     torch's constructor arguments: what each means here, or its refusal
    torch_surface.py  every other member of torch's class: inherited, overridden or refused
    torch_reducer.py  the methods of torch's C++ Reducer that Accelerate and Lightning call
    state_keys.py     checkpoint keys: the prefixes wrapping adds, taken off; sync-state checks

Nothing here is on a gradient's path: the core path is ``ddp/forward.py`` -> ``ddp/reducer.py``
-> ``ddp/buckets.py`` -> ``comm/``.
"""
