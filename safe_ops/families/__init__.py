"""Kernel families: the envelope framework (what a kernel can index, as data) and one module per
family, each with its limits, temporaries, adapter, accuracy facts and the arches it runs on."""
