"""Exact randomness for deferred init: where torch's CPU generator is at a point of a record, the models of torch's
random kernels (which outputs each fill takes), and jumping the generator ahead."""
