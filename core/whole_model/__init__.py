"""Whole-model checks: timing a plan against its baseline in one process, the rounds protocol
(each side alone in fresh processes), and choosing among plan variants on those timings."""
