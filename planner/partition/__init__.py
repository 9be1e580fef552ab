"""Partitioning a VW's layers over its GPUs: exact DP, PuLP MILP and their bounds."""
