/*
 * The outbox protocol as state and steps, for the SPIN model checker.
 * docs/protocol.md describes it in words; model/check.sh runs it (make model, make model-full).
 *
 * Each process step that a crash can follow ends in crash_at(step) or abort_at(step), and the
 * step's name (with '_' for '-') is a failpoint of the code (outbox.Failpoint*):
 * TestModelFailpoints keeps the two lists equal. The one crash elsewhere is a kill during the
 * optimistic INSERT's wait on a copy's claim row: no failpoint can stop there.
 *
 * What is modelled:
 *   - NM messages with NE side effects each (one ordering key per message: its default key),
 *     NCOPY copies of each, copy c delivered to instance c: instance 0 runs the pgx form's
 *     optimistic mode (claim INSERTed at COMMIT, effects inline in it), instance 1, chosen once
 *     for all its deliveries, the pgx form's pessimistic mode (claim INSERT ... ON CONFLICT at
 *     BEGIN, effect rows at COMMIT: the ROWS form) or the database/sql form (the same claim at
 *     BEGIN, its transaction's ID in it, and the effects written into it while the handler runs:
 *     the PINL form), whose effects commit in the claim or, once its writes passed the store's
 *     budget (a spill, -DSPILL: both are tried), as effect rows, the claim holding none;
 *   - one relay, which sweeps before its rounds as the code does, in an instance of either form;
 *   - a cleanup of claims whose retention has passed;
 *   - a clock that moves on while a handler runs and while a Publish call is under way: leases
 *     expire, a round's deadline passes, and a claim's processed_at, taken before its INSERT
 *     waits on a copy's claim row, is passed by the time the claim becomes visible;
 *   - the end: once every delivery is over, time jumps past every lease and grace, and the relay
 *     runs until nothing is due (fair scheduling); then every committed effect must have been sent;
 *   - crashes at every crash point (up to MAXCRASH in all), failed Publish calls (up to MAXFAIL),
 *     and a broker that may or may not redeliver a message that was not acked.
 *
 * Variants (spin -D...): the protocol as it is, with three defects, or as fixed:
 *   OLD_SWEEP  the sweep's watermark is a time (processed_at), looking HORIZON back;
 *              fixed: a transaction ID (the claim's inline_xid, the sweep's snapshot xmin).
 *   OLD_ROUND  a relay round re-sends one by one after a failed Publish call ignoring its
 *              deadline; fixed: no send starts after the deadline, which is inside the lease.
 *   OLD_BLIND  the ROWS form neither reads nor moves inline effects (a duplicate acks without
 *              them, its relay does not sweep); fixed: every form does.
 *   OLD        all three.
 * And one that the code never had, to show the model sees it:
 *   NO_XID     the PINL form's claim carries no transaction ID (inline_xid), as a claim written
 *              without it and then given its effects would: the sweep, which finds claims by
 *              it, never sees them; fixed: the claim takes it at BEGIN.
 */

#ifdef OLD
#define OLD_SWEEP
#define OLD_ROUND
#define OLD_BLIND
#endif

#ifndef NM
#define NM 2
#endif
#define NE 2                /* effects per message, sent in seq order */
#define NCOPY 2             /* copies of each message, copy c to instance c */
#define ND (NM * NCOPY)     /* deliveries */
#ifndef MAXCRASH
#define MAXCRASH 2
#endif
#ifndef MAXFAIL
#define MAXFAIL 1
#endif
#ifndef TMAX
#define TMAX 2              /* the clock's last tick before every delivery is over */
#endif
#define TINF 20             /* the time once every delivery is over: later than every lease and grace */
#ifndef GRACE
#define GRACE 0             /* RelayGrace, for the sweep: it leaves claims younger than this */
#endif
#ifndef RGRACE
#define RGRACE 1            /* RelayGrace, for rows: the relay leaves younger ones to their dispatch */
#endif
#define HORIZON 1           /* how far the old sweep looks back behind its watermark */
#define LEASE 2             /* a relay round's lease */
#define DEADLINE 1          /* a relay round's deadline: half its lease */

#define OPT 0               /* optimistic pgx: claim at COMMIT, effects inline */
#define ROWS 1              /* pessimistic pgx: claim at BEGIN, effect rows */
#define PINL 2              /* database/sql: claim at BEGIN, effects inline, written before COMMIT */

#define E(m, s) ((m) * NE + (s))

/* The invariants, by the names docs/protocol.md gives them. A violation reports the name. */
bool at_most_once;      /* a message's business change commits at most once per consumer */
bool eventually_sent;   /* every committed effect is sent once every delivery is over and the relay has run */
bool committed_uuid;    /* every send of an effect carries the UUID it committed with */
bool key_order;         /* effects of one ordering key are first sent in the order they were recorded */
bool acked_durable;     /* a message is acked only once its effects are sent or durable */
bool cleanup_safe;      /* cleanup removes a claim only once every effect of it was sent */
bool lease_held;        /* a relay sends an effect only while its round holds the key's lease */
#define CHECK(inv, cond) if :: !(cond) -> inv = true; assert(!inv) :: else -> skip fi

/* time, faults, progress */
byte now;
bool draining;          /* every delivery is over: time has passed every lease and grace */
byte crashes, fails;
byte ndone;
byte copiesDone[NM];
bool relayEnd;
bool sweptNow;          /* the relay swept at this tick */
bit relayForm;          /* the form of the instance that runs the relay and the sweep */

/* the database */
bool claimed[NM];       /* a committed claim row */
byte lockedBy[NM];      /* the delivery holding an uncommitted claim row (ROWS, PINL), 0: none */
byte biz[NM];           /* committed business changes */
bool inl[NM];           /* the claim holds its effects inline */
byte ptime[NM];         /* the claim's processed_at */
byte ixid[NM];          /* the xid that wrote the inline effects */
byte cuuid[NM];         /* the attempt whose effects committed (their UUIDs) */
byte row[NM * NE];      /* effect row: 0 none, 1 pending, 2 marked (gone) */
byte leaseTo[NM];       /* next_attempt_at of the key's first pending row, 0: NULL */
byte rowAt[NM];         /* created_at of the rows */
byte W;                 /* the sweep's watermark: a time (OLD_SWEEP) or an xid */
byte nextxid = 1;
byte txid[ND + 1];      /* the xid of each delivery's open transaction, 0: none */

/* the broker */
bool sent[NM * NE];     /* sent at least once */

#define PENDING(m) ((row[E(m, 0)] == 1) || (row[E(m, 1)] == 1))
#define ROWMASK(m) ((row[E(m, 0)] == 1) + 2 * (row[E(m, 1)] == 1))
#define NBITS(p) (((p) & 1) + (((p) >> 1) & 1))

/*
 * crash_at(step) ends the atomic sequence of a step: the process may crash right after it, at the
 * step's failpoint. A crash costs no state of its own: its transaction rolls back (crashed:),
 * nothing is acked, and the broker may redeliver.
 */
#define crash_at(step) if :: crashes < MAXCRASH -> crashes++; goto crashed :: true -> skip fi
/* abort_at(step): a crash inside the sweep's transaction rolls it back whole; the sweep runs again */
#define abort_at(step) if :: goto aborted :: true -> skip fi

/* tick: the step took time (the clock may move on by one, up to TMAX) */
#define tick if :: now < TMAX && !draining -> now++; sweptNow = false :: true -> skip fi

/* handler_fails: the handler may fail (its transaction rolls back, as in a crash, but without the
 * crash) */
#define handler_fails if :: fails < MAXFAIL -> fails++; goto crashed :: true -> skip fi

/*
 * publish sends, in one Publish call, the effects of message m in mask p (seq order) with UUID
 * uuid; k tells how many went out before the call failed, ok whether all did. relay: the caller is
 * a relay round whose lease ends at lto.
 */
inline publish(m, p, uuid, relay, lto) {
	n = NBITS(p);
	if
	:: fails < MAXFAIL -> fails++; ok = false; select(k : 0 .. n - 1)
	:: true -> ok = true; k = n
	fi;
	i = 0; s = 0;
	do
	:: s < NE && i < k ->
		if
		:: (p >> s) & 1 ->
			CHECK(committed_uuid, biz[m] > 0 && uuid == cuuid[m]);
			CHECK(key_order, s == 0 || sent[E(m, s - 1)]);
			if :: relay -> CHECK(lease_held, now < lto) :: else -> skip fi;
			sent[E(m, s)] = true;
			i++
		:: else -> skip
		fi;
		s++
	:: else -> break
	od;
	i = 0; s = 0; n = 0
}

/* firstOf sets out to the mask of the first k effects of mask p */
inline firstOf(p, k, out) {
	out = 0; i = 0; s = 0;
	do
	:: s < NE && i < k -> if :: (p >> s) & 1 -> out = out | (1 << s); i++ :: else -> skip fi; s++
	:: else -> break
	od;
	i = 0; s = 0
}

/* markRows marks the rows in mask p dispatched: they leave the effects table */
inline markRows(m, p) {
	s = 0;
	do
	:: s < NE -> if :: ((p >> s) & 1) && row[E(m, s)] == 1 -> row[E(m, s)] = 2 :: else -> skip fi; s++
	:: else -> break
	od;
	s = 0;
	if :: !PENDING(m) -> leaseTo[m] = 0; rowAt[m] = 0 :: else -> skip fi   /* no row left: their times are gone */
}

/* moveInline moves the inline effects of claim m to pending rows, in the transaction that clears them */
inline moveInline(m) {
	inl[m] = false; rowAt[m] = ptime[m];   /* created_at: when their claim was */
	ptime[m] = 0; ixid[m] = 0;
	row[E(m, 0)] = 1;
	row[E(m, 1)] = 1
}

/* ackCheck: what must hold when message m is acked */
inline ackCheck(m) {
	CHECK(acked_durable, biz[m] > 0
		&& (sent[E(m, 0)] || row[E(m, 0)] == 1 || inl[m])
		&& (sent[E(m, 1)] || row[E(m, 1)] == 1 || inl[m]))
}

/* the background mark of a delivery: written after the ack (or the nack), lost if the instance crashes first */
inline backgroundMark() {
	if
	:: crashes < MAXCRASH -> crashes++
	:: true -> if :: markInl && inl[m] -> inl[m] = false; ptime[m] = 0; ixid[m] = 0 :: else -> skip fi; markRows(m, markp)
	fi;
	markInl = false; markp = 0
}

/*
 * A delivery of a copy of message m to an instance of form form. Its steps, each one transaction
 * or one call: BEGIN with the claim (ROWS) or its look-up (OPT); the handler; COMMIT (OPT: the
 * claim with the effects inline, ROWS: the claim's transaction with the effect rows); the publish
 * from memory; the mark, queued, written after the ack. The duplicate path: list what is pending;
 * move inline effects to rows; publish them; mark.
 */
proctype Delivery(byte d; byte m; byte form) {
	byte xid, T, p, k, n, i, s, markp;
	bool ok, inlSeen, markInl, spilled;

start:
	if
	:: form == OPT ->
		/* BEGIN with the look-up; the handler; COMMIT's round trip takes the claim's processed_at
		 * (clock_timestamp()) */
		atomic {
			xid = nextxid; nextxid++; txid[d] = xid;
			crash_at(after_claim);
			if :: claimed[m] -> txid[d] = 0; xid = 0; goto duplicate :: else -> skip fi;
			tick; handler_fails;
			T = now;
			crash_at(after_handler) }
		/* the INSERT (no ON CONFLICT) waits while a copy holds an uncommitted claim row */
		if
		:: atomic {
			lockedBy[m] == 0 ->
			txid[d] = 0;
			if
			:: claimed[m] -> xid = 0; T = 0; goto duplicate   /* unique violation: a copy won; all rolled back */
			:: else ->
				claimed[m] = true; inl[m] = true; ptime[m] = T; ixid[m] = xid; cuuid[m] = d;
				biz[m]++; CHECK(at_most_once, biz[m] <= 1); xid = 0; T = 0
			fi;
			crash_at(after_commit) }
		:: atomic { crashes < MAXCRASH -> crashes++; goto crashed }   /* killed while it waits: no failpoint stops there */
		fi
	:: form == ROWS ->
		/* INSERT ... ON CONFLICT DO NOTHING waits on a copy's uncommitted claim row. Its xid is
		 * left out of the sweep's xmin: a smaller watermark only makes the sweep look at more. */
		atomic {
			lockedBy[m] == 0 ->
			if :: !claimed[m] -> lockedBy[m] = d :: else -> skip fi;
			crash_at(after_claim);
			if :: claimed[m] -> goto duplicate :: else -> skip fi
		}
		/* the handler, holding the claim row (it takes time); COMMIT with the effect rows */
		atomic { tick; tick }
		atomic {
			handler_fails;
			crash_at(after_handler);
			claimed[m] = true; lockedBy[m] = 0; row[E(m, 0)] = 1; row[E(m, 1)] = 1; rowAt[m] = now; cuuid[m] = d;
			biz[m]++; CHECK(at_most_once, biz[m] <= 1);
			crash_at(after_commit) }
	:: form == PINL ->
		/* the claim at BEGIN takes the transaction's ID (its inline_xid), which stays open, and so
		 * in the sweep's xmin, until COMMIT */
		atomic {
			lockedBy[m] == 0 ->
			if :: !claimed[m] -> lockedBy[m] = d; xid = nextxid; nextxid++; txid[d] = xid :: else -> skip fi;
			crash_at(after_claim);
			if :: claimed[m] -> goto duplicate :: else -> skip fi
		}
		/* the handler writes the effects into the claim as it records them: their time (the
		 * claim's dispatched_at, from which the sweep's grace counts) is the write's; or, past
		 * the budget, moves them to effect rows (created then) and writes the later ones there */
		atomic {
			tick; T = now;
#ifdef SPILL
			if :: spilled = true :: spilled = false fi;
#endif
			tick }
		atomic {
			handler_fails;
			crash_at(after_handler);
			claimed[m] = true; lockedBy[m] = 0; txid[d] = 0; cuuid[m] = d;
			if
			:: spilled -> row[E(m, 0)] = 1; row[E(m, 1)] = 1; rowAt[m] = T
			:: else -> inl[m] = true; ptime[m] = T; ixid[m] = xid
			fi;
#ifdef NO_XID
			ixid[m] = 0; if :: W == 0 -> W = 1 :: else -> skip fi;   /* below every watermark the sweep keeps */
#endif
			biz[m]++; CHECK(at_most_once, biz[m] <= 1); xid = 0; T = 0;
			crash_at(after_commit) }
	fi;

	/* dispatch from memory, with this delivery's UUIDs; on success the mark is queued and M acked */
	atomic {
		publish(m, 3, d, false, 0);
		crash_at(after_publish);
		if
		:: ok -> markInl = (form != ROWS && !spilled); markp = 3 * (form == ROWS || spilled); k = 0; ok = false; spilled = false;
			crash_at(after_mark); ackCheck(m); goto acked
		:: else -> skip
		fi }
	/* failed: inline effects become rows (each marked, retried, parked on its own), the failure
	 * is recorded (due again at once), the sent ones are marked */
	atomic {
		if :: form != ROWS && !spilled && inl[m] -> moveInline(m) :: else -> skip fi;
		if :: form != ROWS && !spilled -> crash_at(after_materialize) :: else -> skip fi;
		spilled = false;
		firstOf(3, k, markp); leaseTo[m] = now + 1; k = 0 }
	goto nacked;

duplicate:
	/* what is still pending: effect rows, and inline effects (which the blind form does not see) */
	atomic {
		p = ROWMASK(m);
#ifdef OLD_BLIND
		inlSeen = inl[m] && form == OPT;
#else
		inlSeen = inl[m];
#endif
		if :: p == 0 && !inlSeen -> ackCheck(m); goto finished :: else -> skip fi }
	if
	:: inlSeen ->
		/* moved to rows, leased as a relay round would lease them */
		atomic {
			if :: inl[m] -> moveInline(m); leaseTo[m] = now + LEASE :: else -> skip fi;
			p = ROWMASK(m); inlSeen = false;
			crash_at(after_materialize);
			if :: p == 0 -> ackCheck(m); goto finished :: else -> skip fi }
	:: else -> skip
	fi;
	atomic {
		publish(m, p, cuuid[m], false, 0);
		crash_at(after_publish);
		if
		:: ok -> markp = p; p = 0; k = 0; ok = false; crash_at(after_mark); ackCheck(m); goto acked
		:: else -> skip
		fi;
		firstOf(p, k, markp); leaseTo[m] = now + 1; k = 0; p = 0 }
	goto nacked;

acked:
	atomic { backgroundMark(); goto finished }
nacked:
	atomic { backgroundMark(); ok = false; goto redeliver }
crashed:
	atomic {
		if :: lockedBy[m] == d -> lockedBy[m] = 0 :: else -> skip fi; txid[d] = 0;
		xid = 0; T = 0; p = 0; k = 0; n = 0; markp = 0; ok = false; inlSeen = false; markInl = false; spilled = false;
redeliver:
		if
		:: goto start            /* the broker redelivers */
		:: true -> skip          /* it does not (dead-lettered, acked by an operator): the relay must finish */
		fi;
finished:
		copiesDone[m]++; ndone++;
		if :: ndone == ND -> draining = true; now = TINF; sweptNow = false :: else -> skip fi
	}
}

/*
 * sweep: the relay's move of inline effects left behind to rows, in one transaction, before a
 * round (EffectClaimDue), at most once per tick (the code: once per quarter of RelayGrace). An
 * aborted sweep changes nothing and may run again.
 */
inline sweep() {
#ifdef OLD_BLIND
	if :: relayForm == ROWS -> goto swept :: else -> skip fi;   /* a blind instance does not sweep */
#endif
	abort_at(after_sweep_move);
	abort_at(before_sweep_watermark);
	hi = now - GRACE;
#ifdef OLD_SWEEP
	/* a time watermark: processed_at in [least(W, hi) - HORIZON, hi) */
	lo = W; if :: hi < lo -> lo = hi :: else -> skip fi; lo = lo - HORIZON;
	m = 0;
	do
	:: m < NM -> if :: claimed[m] && inl[m] && ptime[m] >= lo && ptime[m] < hi -> moveInline(m) :: else -> skip fi; m++
	:: else -> break
	od;
	if :: hi > W -> W = hi :: else -> skip fi;
#else
	/* a transaction-ID watermark: claims whose inline_xid >= W; the new one is the least of the
	 * snapshot's xmin and the inline_xid of every claim in range still holding effects */
	xm = nextxid; m = 1;
	do
	:: m <= ND -> if :: txid[m] != 0 && txid[m] < xm -> xm = txid[m] :: else -> skip fi; m++
	:: else -> break
	od;
	nw = xm; m = 0;
	do
	:: m < NM ->
		if
		:: claimed[m] && inl[m] && ixid[m] >= W && ptime[m] < hi -> moveInline(m)
		:: claimed[m] && inl[m] && ixid[m] >= W && ptime[m] >= hi -> if :: ixid[m] < nw -> nw = ixid[m] :: else -> skip fi
		:: else -> skip
		fi;
		m++
	:: else -> break
	od;
	W = nw;
#endif
swept:
	sweptNow = true;
aborted:
	m = 0; xm = 0; nw = 0; lo = 0; hi = 0
}

/* the relay: rounds of one key's leased effects, published holding nothing */
/* due: pending, and past RelayGrace since created or handed over by a failure, and not leased */
#define DUE(m) (PENDING(m) && (draining || (leaseTo[m] == 0 && rowAt[m] + RGRACE <= now) || (leaseTo[m] != 0 && leaseTo[m] <= now)))
#define ROUND(mm) atomic { DUE(mm) -> m = mm; t0 = now; leaseTo[m] = now + LEASE; p = ROWMASK(m); crash_at(after_relay_claim) }
#ifdef OLD_ROUND
#define IN_ROUND true
#else
#define IN_ROUND (now <= t0 + DEADLINE)
#endif

#if NM == 1
#define NONE_PENDING (!PENDING(0))
#elif NM == 2
#define NONE_PENDING (!PENDING(0) && !PENDING(1))
#else
#define NONE_PENDING (!PENDING(0) && !PENDING(1) && !PENDING(2))
#endif

proctype Relay() {
	byte m, t0, p, k, n, i, s, markp, left, one, xm, nw;
	short lo, hi;
	bool ok;

	do
	:: atomic { !sweptNow -> sweep() }
	:: ROUND(0) -> goto round
#if NM > 1
	:: ROUND(1) -> goto round
#endif
#if NM > 2
	:: ROUND(2) -> goto round
#endif
	:: atomic { draining && sweptNow && NONE_PENDING -> relayEnd = true }; break
round:
		/* the first Publish call: every claimed effect (one topic); none after the deadline */
		atomic {
			if
			:: now <= t0 + DEADLINE -> publish(m, p, cuuid[m], true, t0 + LEASE); firstOf(p, k, markp)
			:: else -> ok = false; k = 0; n = NBITS(p)
			fi;
			tick;
			crash_at(after_publish);
			if :: !ok && n - k > 1 -> left = p & ~markp :: else -> skip fi;
			n = 0; k = 0 }
		/* a call that failed for several effects: one by one, so that only the culprit is charged;
		 * once one fails, the later ones of its key wait */
		do
		:: left == 0 -> break
		:: atomic {
			left != 0 && IN_ROUND ->
			one = ((left & 1) -> 1 : 2);
			publish(m, one, cuuid[m], true, t0 + LEASE);
			if :: ok -> markp = markp | one; left = left & ~one :: else -> left = 0 fi;
			one = 0; k = 0;
			tick;
			crash_at(after_publish) }
		:: atomic { left != 0 && !IN_ROUND -> left = 0 }   /* past the deadline: not tried */
		od;
		atomic {
			markRows(m, markp);
			crash_at(after_relay_mark);
			if :: (p & ~markp) != 0 -> leaseTo[m] = now + 1 :: else -> skip fi;   /* failures recorded: due after a backoff */
			m = 0; t0 = 0; p = 0; markp = 0; ok = false }
		goto next;
crashed:                         /* the round is abandoned; its lease runs out */
		atomic { m = 0; t0 = 0; p = 0; k = 0; n = 0; markp = 0; left = 0; one = 0; ok = false }
next:
		skip
	od
}

/* cleanup: once the broker can no longer deliver the message (Retention outlasts it), its claim
 * goes when it holds no effects and no row of it is pending */
#define CLEANABLE(m) (claimed[m] && copiesDone[m] == NCOPY && !inl[m] && !PENDING(m))
#define CLEAN(mm) atomic { CLEANABLE(mm) -> CHECK(cleanup_safe, sent[E(mm, 0)] && sent[E(mm, 1)]); claimed[mm] = false }

proctype Cleanup() {
end:
	do
	:: CLEAN(0)
#if NM > 1
	:: CLEAN(1)
#endif
#if NM > 2
	:: CLEAN(2)
#endif
	od
}


init {
	byte m, e, form1;
	atomic {
#ifdef FORM1
		form1 = FORM1;   /* one form for instance 1 (a smaller search) */
#else
		if :: form1 = ROWS :: form1 = PINL fi;
#endif
#ifdef OLD_BLIND
		if :: relayForm = OPT :: relayForm = ROWS fi;   /* the fixed protocol does not depend on it */
#endif
		m = 0;
		do
		:: m < NM -> run Delivery(2 * m + 1, m, OPT); run Delivery(2 * m + 2, m, form1); m++
		:: else -> break
		od;
		m = 0;
		run Relay(); run Cleanup()
	}
	(ndone == ND && relayEnd);
	e = 0;
	do
	:: e < NM * NE -> CHECK(eventually_sent, biz[e / NE] == 0 || sent[e]); e++
	:: else -> break
	od
}
