"""Tensor-parallel generations on one host: rank processes started by deploykit (``group``), each
building its share of the model and stepping in lockstep (``rank``)."""
