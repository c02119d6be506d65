"""The parts of ``python -m routerlab.ab.validate`` (routerlab.ab.validate): what every run shares
(context), the truth (truth), one design on a fresh fleet (design), and the table set beside the
truth (report)."""
