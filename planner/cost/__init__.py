"""The cost model: what a plan costs, in time and memory."""
