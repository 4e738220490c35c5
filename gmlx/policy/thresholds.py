"""The online control's thresholds, each with why: when it tries speculation, explores, measures
plain rounds beside speculative ones, and what figure it never trusts (the arithmetic that uses
them: gmlx/policy/width_control.py; the whole rule: gmlx/policy/control.py)."""

TRY_FIRST = 0.9  # before any measurement, speculation is tried unless predicted below this
TRY_WITHIN = 0.9  # an unmeasured K predicted at least this fraction of the best is measured
# ... at the lone request's width, only one whose hope (its deeper drafts credited as if they
# always agreed once reached: already the most it could yield) reaches the best's gain: there the
# tries recur (a K not run for RETRY_AFTER rounds is untried again) within each request, and on
# SmolLM2 float32 (128-token answers, this CPU) K = 2-3 tried at 0.9 of K = 1's gain ran 0.65-0.94x
# on chat; the control with a K ceiling of 1 beat the default in 9 of 10 paired runs (1-5 %).
# Since early dispatch (gmlx/models/early_dispatch.py, 2026-12-06) a lone K = 1 round costs ~1.10 plain
# rounds here and K = 2 / 3 1.43 / 1.56: no try on hope at all (infinite), a deeper K runs only where the
# request's own per-position estimates predict it best. On the jittered simulated clock (sim_control.py
# `notries`, SmolLM2 float32, 4 x 48 tokens, 6 seeds) chat 1.085x -> 1.111x of plain, code 1.312x -> 1.325x.
# A trade: the embedded model, whose deeper drafts agree once the first does, found its K = 3 through
# these tries (wall time, with LONE_MIN_EVIDENCE below, 3 runs: 1.28-1.30x -> 1.16-1.24x of plain).
LONE_TRY_WITHIN = float("inf")
# A batch width's first MIN_EVIDENCE speculative rounds draft K = 1, whatever the prior predicts:
# they measure the acceptance at the cheapest round (the lone request's tries are K = 1 too:
# LONE_TRY). A first try at the prior's K = 3 that met a poor start weighed K = 3's cost against
# it and sent the width plain: in the simulated engine (benchmarks/sim_control.py: SmolLM2 float32,
# this CPU's round costs, 64-token answers) code at c = 4 ran 1.02x of plain without the rule and
# 1.18x with it, code at c = 2 1.16x -> 1.20x, chat at c = 4 0.97x -> 0.99x; the lone request is
# unchanged. Deeper K's follow from the measured acceptance (the tries, `_neighbour_to_try`).
FIRST_K1 = True
# A batch width whose plain rounds shadow (gmlx/decode/batch_shadow.py: the drafter replays their
# steps, K = 1 records at that width) starts plain: what a first try would measure, the drafts'
# acceptance, the shadows measure for less (1 % of a round with OpenBLAS, ~3-8 % with the kernel:
# SHADOW_SPAN below, against a try's ~25 % on a chat answer), and the round's cost at that width comes
# from the probe's forwards of its rows (policy/costs.py: Costs.at_width); it speculates once both
# predict a gain (MARGIN, after MIN_EVIDENCE rounds). With the CPU's small-M kernel a try at the
# prior's acceptance (0.6) cost more than it found: in the simulated engine (SmolLM2 float32, the
# kernel's round costs, 64-token answers) chat at c = 4 ran 0.96x of plain with first tries. Such a
# width explores (EXPLORE_FIRST) only a K predicted at least TRY_FIRST: an exploration at chat's
# measured 0.82x only confirmed it.
SHADOW_FIRST = True
# ... and a plain width's shadows stop after this many rounds where every K is predicted under
# SHADOW_STOP (control.far_from_paying): three replays' records (shadow.SHADOW_EVERY = 8) had their
# chance to show the drafts agreeing more. With the kernel a gated SmolLM2 float32 batch's shadows
# cost 5-8 % of its run at c = 2-4 (/tmp A/B, wall time), where the simulator had assumed 1 %.
SHADOW_SPAN = 24
# ... every K predicted under this, where a switch needs MARGIN (figures.MARGIN): records that leave
# the width short of a switch change nothing unless its drafts come to agree more, which its
# exploration then measures. A gated batch's shadows cost 7-8 % of its CPU time at c = 4 (SmolLM2
# float32 with the kernel, interleaved closed loops: 1.075x of plain against 0.995x without them;
# capturing and committing the hidden states ~3 %, the head's replays and records ~4.5 %). Stopped
# only under TRY_FIRST, chat widths (K = 1 predicted 0.93-1.0x at c = 2) shadowed throughout: on the
# simulated clock (sim_control.py --carry) chat c = 2 ran 0.931x of plain, 0.954x with this level;
# code c = 4 0.918x -> 0.931x; no cell slower (in wall time unresolved: docs/cpu_kernel.md).
SHADOW_STOP = 1.05
# ... until the width's exploration (EXPLORE_FIRST plain rounds, doubling) starts them again for
# SHADOW_SPAN rounds, where no K is predicted TRY_FIRST: the shadows measure what a try would, the
# drafts' acceptance, for ~5 % of a round where a K = 1 try at SmolLM2 chat's 0.27 ran ~0.87x of
# plain for MIN_EVIDENCE rounds and its gate's shadows then ran SHADOW_SPAN rounds anyway. On the
# simulated clock (sim_control.py, 48-token answers, c = 2) chat 0.953x -> 0.976x of plain. A K
# predicted at least TRY_FIRST is still tried (the exploration as before).
SHADOW_AGAIN = True
# ... and where a width's rounds shadow, its exploration tries no K whose hope (its deeper drafts
# credited as always agreeing) is under MARGIN: the shadows measure the acceptance a try would, the
# width's round costs are measured, and a try that could not stay (it must pay MARGIN, surely) only
# costs its rounds. Seen on SmolLM2 float32 at c = 2 (code, wall time, 2026-12-06): a width settled
# plain at K = 1's 0.94x explored K = 3 on a hope of 1.02x, 6 rounds at 2.7 plain rounds each.
KEEPABLE_TRIES = True
MIN_EVIDENCE = 6  # rounds of a choice before the control may leave it (its figures must exist)
# ... for the lone request: its shadow rounds (gmlx/decode/shadow.py) keep its acceptance current while
# plain, and a plain stretch held 6 rounds where K = 1 (~1.10 plain rounds since early dispatch) pays at
# an acceptance of ~0.1 cost it more than it saved. Simulated (as LONE_TRY_WITHIN's, with it): chat
# 1.111x -> 1.158x of plain, code 1.325x (K = 1 every round 1.152x / 1.390x); at batch widths 3 lost
# 3.3 % on code at c = 2 (`minev3`), so they keep 6.
LONE_MIN_EVIDENCE = 3
EXPLORE_FIRST, EXPLORE_MAX = 64, 1024  # plain rounds at a width before speculation is tried again
# ... and while plain is in force only for want of certainty — the best K predicted MARGIN above
# plain, but not by Z standard errors — after this many, with no back-off: the expected gain of a
# try is positive, and what is missing is evidence, which each try adds (its pairs and rounds;
# the doubt falls as their count grows), so a gain that is real becomes sure within a few tries
# and one that is not falls under MARGIN, where the doubling back-off takes over again. A lone
# SmolLM2 float32 request at ~1.15x (doubt 0.2-0.4 after 8 rounds) otherwise drafted in 3 % to
# 96 % of rounds from one repeat to the next, by how its first try went.
EXPLORE_SOON = 16
PLAIN_WINDOW = 5  # plain rounds a speculating width runs when nothing pairs its rounds with plain ones
PLAIN_CHECK_AFTER = 4  # speculative rounds at a width before that plain window
REFRESH_WINDOW = 3  # plain rounds of a refresh of the pairs while speculating ...
REFRESH_FIRST, REFRESH_MAX = 64, 512  # ... after this many speculative rounds without a pair (doubling)
RETRY_AFTER = 64  # speculative rounds at other K's after which a K's figures are stale (measured again if it may win)
# A choice predicted this far above plain — by its own figures and, where both are timed here, by
# the two medians too — is not one a plain window could overturn: a round's time drifts ~25 % from
# one minute to the next on a shared VM, and drift moves both kinds alike. Its windows (the first
# and the refreshes) are skipped while it stays there: each costs a gate, plain rounds and a
# resume (a lone request decodes its last tokens plain), ~5 % of a short burst of the micro model.
FAR = 1.5
# A new lone request tries K = 1 where plain is in force, unless the pool predicts K = 1 under
# TRY_FIRST; the try stays past its first rounds only if the request's own gain is sure (a
# tentative choice), and a request may stop only after MIN_ROUNDS_TO_STOP of its own rounds anyway.
# Requests differ more than rounds do: on SmolLM2 float32 a code answer accepts ~0.45 of K = 1's
# drafts, a chat answer ~0.25 (about even with plain there); decided on the pool's hysteresis, the
# code requests after chat ones decoded plain throughout (5 of 16 with the K ceiling 1 that
# `sweep-cap --write` records here). K = 1 is the cheapest try: at zero acceptance a round still
# yields one token for ~1.2 plain steps.
LONE_TRY = True
# A lone request is decided on its predicted gain alone (MARGIN to enter or keep a try, STAY to
# stay), without the doubt (Z standard errors), once its width's cost ratio is paired: its own
# rounds keep measuring it, and a request sent plain keeps its drafter and re-arms
# (REARM_MIN below), so a wrong choice costs the rounds until they show it. With
# the doubt, a SmolLM2 chat answer (K = 1-2 predicted ~1.05-1.3x, doubt 0.1-1 after 8 rounds of
# one request) went plain for good after its first 8 rounds, where drafting throughout ran 1.13x
# (128 tokens). Before a pair the doubt stays: the load probe's forward-only ratio errs low.
# What is uncertain then is the request's own acceptance: sent plain at a gain within Z of its
# standard error of 1 (width_control.acceptance_doubt), it tries again after EXPLORE_SOON rounds.
LONE_POINT = True
# A k round's cost relative to a plain one is at least 1: its verify reads every weight a plain
# step reads (and the drafter's besides). A measured ratio below it is the machine's noise (traced
# under load: a SmolLM2 K=3 round "0.64x a plain one's, paired", and a chat request accepting 13 %
# drafted 38 rounds on it), so a gain is never credited with one.
MIN_RATIO = 1.0
# The lone request's cost ratios come from steady samples where it has them (pairs.Pairs `warm`): a
# speculative run's periods past its first STEADY_WARM after plain ones, against the plain periods
# timed within seconds of them, not only the periods next to a plain / speculative boundary, which
# read a K = 1 round 6-10 % dearer than mid-run on SmolLM2 float32 on an AMD EPYC (the re-arm's catch-up,
# plain stretches' shadow replays). On the simulated clock with that switch cost the lone chat request went
# from 1.05x to 1.11x of plain, K = 1 every round's figure; on an Intel Xeon with no such cost both read
# the same ratio (docs/speculation.md, "Steady pairs"). False: boundary pairs alone (before 2026-12-07).
STEADY_PAIRS = True
# A lone request the control sends plain (or into a plain window) with more than this many tokens left
# keeps its drafter: its plain steps keep their hidden states (PlainDecoder `keep_hidden`; a drafter that
# replays them measures its acceptance meanwhile: decode/shadow.py), the control is asked every plain
# round (and its own context looked up: drafters/context_lookup.py), and on a re-arm the drafter takes
# those steps as pending entries, as it takes a prompt (docs/speculation.md: without it a SmolLM2 chat
# answer, 0.12 of drafts agreeing over its first rounds and ~0.3 after, went plain for good).
REARM_MIN = 16
# Tokens left when a lone request runs the control's plain window at its tail (it cannot re-arm after
# it): the window's rounds (5 the first time, 3 for a refresh), all timed, and the switch's, not.
WINDOW_TAIL_EXTRA = 1
