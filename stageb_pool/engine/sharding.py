"""One worker's model spread over its GPU group (the transformers engine's device map), from
the model's structure alone, never from free memory (as ``device_map="auto"`` would), so every
worker and rerun of a group size splits it alike (the layout: docs/architecture.md, "GPU
groups"). torch, accelerate and transformers are imported inside the functions.
"""

from __future__ import annotations

SHARDING = "layers"  # engine.info()["sharding"] for this scheme: contiguous runs of decoder layers


def decoder_layers(model) -> str:
    """The name of the model's decoder layer list: its ``ModuleList`` with the most
    parameters (a VL model's language layers outweigh its vision blocks)."""
    import torch

    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no layer list to split over GPUs")
    return max(lists, key=lambda item: (sum(p.numel() for p in item[1].parameters()), len(item[1])))[0]


def layer_split_map(model, devices: list[str]) -> dict[str, str]:
    """The device map (module name -> torch device) of ``model`` over ``devices``, in order."""
    layers_name = decoder_layers(model)
    modules = dict(model.named_modules())
    count = len(modules[layers_name])
    first, last = devices[0], devices[-1]
    device_map: dict[str, str] = {}
    for i in range(count):
        # GPU g holds layers [g*count//n, (g+1)*count//n): equal runs, in order.
        device_map[f"{layers_name}.{i}"] = devices[min(len(devices) - 1, i * len(devices) // count)]
    tied_to = _tied_heads(model)
    # Walk from the root down to the layer list; its siblings before it go first, after it last.
    path = layers_name.split(".")
    for depth in range(len(path)):
        parent = ".".join(path[:depth])
        before = True
        for child, module in modules[parent].named_children() if parent else model.named_children():
            name = f"{parent}.{child}" if parent else child
            if child == path[depth]:
                before = False
                continue
            if name in tied_to:
                device_map[name] = first  # a head tied to the embeddings shares their weight
            else:
                device_map[name] = first if before else last
    return device_map


def _tied_heads(model) -> set[str]:
    """Modules whose weight is the input embeddings' (a tied LM head)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    embeddings = model.get_input_embeddings()
    return {name for name, module in model.named_modules()
            if module is not embeddings and getattr(module, "weight", None) is embeddings.weight}


def dispatch(model, devices: list[str]):
    """``model`` (built in memory: the tiny model) placed over ``devices``, the hooks forced
    even on one device, so a one-GPU (or CPU) test runs the code path of a real group."""
    from accelerate import dispatch_model

    return dispatch_model(model, layer_split_map(model, devices), main_device=devices[0], force_hooks=True)


def empty_model(config, cls, *, trust_remote_code: bool = False):
    """The model ``cls`` of ``config`` without weights, to map a checkpoint before loading it."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return cls.from_config(config, trust_remote_code=trust_remote_code)
