/*
 * Two relays sharing one ordering key, for the SPIN model checker (model/check.sh runs it beside
 * model/outbox.pml; docs/protocol.md, "Several relays").
 *
 * outbox.pml has one relay, whose rounds end before the next begins. What it cannot show is the
 * hand-over between relays: when a round lets go of an effect, and whether what it writes after
 * that can undo another relay's claim. This model has the relay's rows as the code has them:
 *
 *   - NE effects of one ordering key, in id order; a row is pending until it is marked, and its
 *     next_attempt_at (nextAt) is NULL (0: due), a retry time, or the end of a lease;
 *   - a claim leases the first pending effect of the key when it is due (the later ones wait
 *     behind it), and a round sends that one and the due ones after it, in order, holding no lock;
 *   - a call either returns (sent, or failed), or is still running when the relay shuts down: a
 *     Publisher takes no context, so the call goes on and may deliver; every call ends before the
 *     lease of its round ends (a call is bounded by PublishTimeout, the lease is twice that and more);
 *   - a round starts no call after its deadline, and writes its outcome before its lease ends, in
 *     two statements, each atomic: the failures (a first failure is due again at once, no
 *     backoff; an effect not tried is due again at once), and the marks;
 *   - a clock that moves on while calls run, up to TMAX.
 *
 * The invariant (one_call): no effect has two calls in flight at once. A second call of an effect
 * whose first call is still running puts two copies on the wire while the first may yet fail; the
 * lease exists to prevent it.
 *
 * Variants (spin -D...):
 *   OLD_RELEASE  a shutdown records the effect of a call still in flight as not tried: due at once,
 *                and the other relay sends it again beside the running call; fixed: it keeps its
 *                lease until the lease ends.
 *   OLD_ORDER    the round writes its marks before its failures: between the two, an effect that
 *                failed behind a sent one is the key's first pending effect, due, and the other
 *                relay leases it and calls; the failure record then makes it due at once over that
 *                lease, and it is sent again beside that call; fixed: failures first (until the
 *                marks land, every effect they touch waits behind the round's own leased effect).
 */

#define NE 2             /* CALLS_ALLOW below names both */
#define TMAX 5
#define LEASE 3
#define DEADLINE 1      /* a round starts no call after its deadline, which is inside its lease */

#define OK 1
#define FAILED 2
#define NOT_TRIED 3
#define IN_FLIGHT 4

byte now = 1;
bool marked[NE];
byte nextAt[NE];        /* 0: NULL, due; otherwise due once it is <= now */
byte calls[NE];         /* calls of the effect in flight */
byte callEnds[NE];      /* the lease end that a call in flight of the effect ends before */
byte roundEnds[2];      /* the lease end of each relay's round in progress: it lands before (0: none) */
bool one_call;

#define CHECK(inv, cond) if :: !(cond) -> inv = true; assert(!inv) :: else -> skip fi
#define DUE(e) (nextAt[e] == 0 || nextAt[e] <= now)
#define FIRST (!marked[0] -> 0 : (!marked[1] -> 1 : NE))   /* the key's first pending effect */

/* The clock moves on, but never past the lease end of a call in flight: calls end within their lease. */
#define BEFORE(t) (t == 0 || now + 1 < t)
#define CALLS_ALLOW (BEFORE(callEnds[0]) && BEFORE(callEnds[1]) && BEFORE(roundEnds[0]) && BEFORE(roundEnds[1]))

active proctype Clock() {
end:
	do
	:: atomic { now < TMAX && CALLS_ALLOW -> now++ }
	od
}

/* A call that a shutdown stopped waiting for: it returns later, within its lease. */
proctype Straggler(byte e) {
	atomic { calls[e]--; if :: calls[e] == 0 -> callEnds[e] = 0 :: else -> skip fi }
}

inline call(e, lto) {
	atomic {
		calls[e]++;
		CHECK(one_call, calls[e] <= 1);
		callEnds[e] = lto
	}
}

inline returned(e) {
	atomic { calls[e]--; if :: calls[e] == 0 -> callEnds[e] = 0 :: else -> skip fi }
}

/* the failures of the round: a first failure and an effect not tried are due at once */
inline writeFailures() {
	atomic {
		i = 0;
		do
		:: i < NE ->
			if
			:: res[i] == FAILED || res[i] == NOT_TRIED -> nextAt[i] = now
#ifdef OLD_RELEASE
			:: res[i] == IN_FLIGHT -> nextAt[i] = now
#else
			:: res[i] == IN_FLIGHT -> nextAt[i] = lto   /* leased again until the lease ends */
#endif
			:: else -> skip
			fi;
			i++
		:: else -> break
		od
	}
}

inline writeMarks() {
	atomic {
		i = 0;
		do
		:: i < NE -> if :: res[i] == OK -> marked[i] = true :: else -> skip fi; i++
		:: else -> break
		od
	}
}

proctype Relay(byte r) {
	byte f, e, i, lto;
	byte res[NE];
	bool down;
end:
	do
	:: atomic { !down && FIRST < NE && DUE(FIRST) ->
			/* the claim: the first pending effect of the key, when due, is leased */
			f = FIRST;
			lto = now + LEASE;
			roundEnds[r] = lto;
			nextAt[f] = lto;
			/* the round takes the leased effect and the due ones after it, up to the first not due */
			i = 0;
			do :: i < NE -> res[i] = 0; i++ :: else -> break od;
			i = f;
			do :: i < NE && (i == f || DUE(i)) -> res[i] = NOT_TRIED; i++ :: else -> break od
		}
		/* the round: what it took, in order */
		e = f;
		do
		:: atomic { e < NE && res[e] == NOT_TRIED && !down && now <= lto - LEASE + DEADLINE ->
			call(e, lto) }
			if
			:: returned(e); res[e] = OK; e++
			:: returned(e); res[e] = FAILED; e++; break   /* the key's later effects wait */
			:: down = true; res[e] = IN_FLIGHT; run Straggler(e); e++; break
			fi
		:: else -> break
		od;
		/* the outcome, in two statements */
#ifdef OLD_ORDER
		writeMarks();
		writeFailures();
#else
		writeFailures();
		writeMarks();
#endif
		roundEnds[r] = 0
	:: down -> break
	od
}

init {
	atomic {
		run Relay(0);
		run Relay(1)
	}
}
