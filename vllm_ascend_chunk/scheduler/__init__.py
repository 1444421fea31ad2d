"""Scheduler side (engine core): pool index, planning of chunk prefills, loads, stats."""
