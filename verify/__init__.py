"""Verification: does a compiled pipeline compute what its source model computes?

`compiled` checks a compiled directory (or the in-memory static models) against the source
model on other engines; `goldens` records and checks golden outputs users keep in their own
CI; `bisect` finds the first pass, and the first tensor, where numbers change.
"""
