"""Parameter names and shapes of the models the network benchmark can stand in for (``--model``), and the
synthetic gradient's own layout (``--numel``): lists of ``(parameter name, shape)`` in the optimizer's exchange
order (sorted by name). Nothing is allocated here; the workers build zero parameters of these shapes.
"""

from __future__ import annotations

import argparse


def _resnet(block, layers, classes=1000):
    """torchvision.models.resnet (v1.5): names and shapes of ``named_parameters()`` (BN buffers excluded)."""
    out = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    expansion = 4 if block == "bottleneck" else 1
    inplanes = 64
    for li, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers), 1):
        for b in range(blocks):
            pre = f"layer{li}.{b}."
            if block == "basic":
                convs = [(inplanes, planes, 3), (planes, planes, 3)]
            else:
                convs = [(inplanes, planes, 1), (planes, planes, 3), (planes, planes * 4, 1)]
            for ci, (cin, cout, ks) in enumerate(convs, 1):
                out += [(f"{pre}conv{ci}.weight", (cout, cin, ks, ks)), (f"{pre}bn{ci}.weight", (cout,)),
                        (f"{pre}bn{ci}.bias", (cout,))]
            if b == 0 and (li > 1 or inplanes != planes * expansion):
                out += [(f"{pre}downsample.0.weight", (planes * expansion, inplanes, 1, 1)),
                        (f"{pre}downsample.1.weight", (planes * expansion,)),
                        (f"{pre}downsample.1.bias", (planes * expansion,))]
            inplanes = planes * expansion
    return out + [("fc.weight", (classes, 512 * expansion)), ("fc.bias", (classes,))]


def _convnet(features, classifier):
    """torchvision-style ``features.<i>`` convolutions and ``classifier.<i>`` linear layers."""
    out = []
    for prefix, layers in (("features", features), ("classifier", classifier)):
        for i, shape in layers:
            out += [(f"{prefix}.{i}.weight", shape), (f"{prefix}.{i}.bias", (shape[0],))]
    return out


def _vgg16():
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    feats, i, cin = [], 0, 3
    for c in cfg:                       # Sequential indices count the ReLU and MaxPool modules too
        if c == "M":
            i += 1
        else:
            feats.append((i, (c, cin, 3, 3)))
            i, cin = i + 2, c
    return _convnet(feats, [(0, (4096, 512 * 7 * 7)), (3, (4096, 4096)), (6, (1000, 4096))])


def _alexnet():
    return _convnet([(0, (64, 3, 11, 11)), (3, (192, 64, 5, 5)), (6, (384, 192, 3, 3)), (8, (256, 384, 3, 3)),
                     (10, (256, 256, 3, 3))],
                    [(1, (4096, 256 * 6 * 6)), (4, (4096, 4096)), (6, (1000, 4096))])


def _bert_base(vocab=30522, hidden=768, layers=12, inter=3072, positions=512):
    """Hugging Face ``BertModel`` (bert-base-uncased), pooler included."""
    h = hidden
    out = [("embeddings.word_embeddings.weight", (vocab, h)), ("embeddings.position_embeddings.weight", (positions, h)),
           ("embeddings.token_type_embeddings.weight", (2, h)), ("embeddings.LayerNorm.weight", (h,)),
           ("embeddings.LayerNorm.bias", (h,))]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for lin in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            out += [(f"{p}{lin}.weight", (h, h)), (f"{p}{lin}.bias", (h,))]
        out += [(f"{p}attention.output.LayerNorm.weight", (h,)), (f"{p}attention.output.LayerNorm.bias", (h,)),
                (f"{p}intermediate.dense.weight", (inter, h)), (f"{p}intermediate.dense.bias", (inter,)),
                (f"{p}output.dense.weight", (h, inter)), (f"{p}output.dense.bias", (h,)),
                (f"{p}output.LayerNorm.weight", (h,)), (f"{p}output.LayerNorm.bias", (h,))]
    return out + [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]


def _gpt2(vocab=50257, hidden=768, layers=12, positions=1024):
    """Hugging Face ``GPT2Model`` (gpt2, "small"; the LM head is tied to ``wte``)."""
    h = hidden
    out = [("wte.weight", (vocab, h)), ("wpe.weight", (positions, h))]
    for i in range(layers):
        p = f"h.{i}."
        out += [(f"{p}ln_1.weight", (h,)), (f"{p}ln_1.bias", (h,)),
                (f"{p}attn.c_attn.weight", (h, 3 * h)), (f"{p}attn.c_attn.bias", (3 * h,)),
                (f"{p}attn.c_proj.weight", (h, h)), (f"{p}attn.c_proj.bias", (h,)),
                (f"{p}ln_2.weight", (h,)), (f"{p}ln_2.bias", (h,)),
                (f"{p}mlp.c_fc.weight", (h, 4 * h)), (f"{p}mlp.c_fc.bias", (4 * h,)),
                (f"{p}mlp.c_proj.weight", (4 * h, h)), (f"{p}mlp.c_proj.bias", (h,))]
    return out + [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]


#: ``--model`` name -> (builder of [(parameter name, shape)], total, source). The totals are the published
#: parameter counts (torchvision's model docs, "num_params"; Hugging Face model cards), and the tests check
#: that the shapes add up to them.
MODELS = {
    "resnet18": (lambda: _resnet("basic", (2, 2, 2, 2)), 11_689_512, "torchvision.models.resnet18"),
    "resnet50": (lambda: _resnet("bottleneck", (3, 4, 6, 3)), 25_557_032, "torchvision.models.resnet50"),
    "resnet101": (lambda: _resnet("bottleneck", (3, 4, 23, 3)), 44_549_160, "torchvision.models.resnet101"),
    "alexnet": (_alexnet, 61_100_840, "torchvision.models.alexnet"),
    "vgg16": (_vgg16, 138_357_544, "torchvision.models.vgg16"),
    "bert-base": (_bert_base, 109_482_240, "transformers BertModel, bert-base-uncased"),
    "gpt2": (_gpt2, 124_439_808, "transformers GPT2Model, gpt2 (small)"),
}


def model_layout(name):
    """``[(parameter name, shape)]`` of ``--model name``, sorted by name (the optimizer's exchange order)."""
    if name not in MODELS:
        raise ValueError(f"hvd_sparse.bench network: unknown model {name!r}; choose from {', '.join(MODELS)}")
    return sorted(MODELS[name][0](), key=lambda t: t[0])


def synthetic_layout(n, layers=16):
    """``--numel n``: the synthetic gradient's own layer sizes as 1-D parameters ``synthetic.00``, ...
    (in name order == layout order, so each parameter holds one of the gradient's layers)."""
    from .data import layer_sizes

    sizes = layer_sizes(n, layers)
    return [(f"synthetic.{i:02d}", (s,)) for i, s in enumerate(sizes)]


def model_choice(text):
    if text not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; choose from {', '.join(MODELS)}")
    return text
