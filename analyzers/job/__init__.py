"""Stage 5: a job of several ranks analysed as one: ranks, collectives, the straggler and the charge of waits to it, several traces joined."""
