"""Oracles and fixtures the tests and benchmarks use, not the product: the single-process
reference trainer (`reference`) that pipelined runs must match, and the hand-split toy model
(`toy`) that exercises the runtime without the compiler."""
