// Package proccpu reads CPU time for the benchmarks and measurement harnesses: this process's
// (getrusage) and a PostgreSQL server's on the same machine (every server process's, from /proc),
// so that a cost per message can be told apart between the client and the server.
package proccpu

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Self is this process's user + system CPU time, or 0 where getrusage fails.
func Self() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Postmaster finds the server's postmaster: the parent of one of db's backends, which must run on
// this machine (/proc).
func Postmaster(ctx context.Context, db *sql.DB) (int, error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return 0, fmt.Errorf("proccpu: %w", err)
	}
	defer conn.Close()
	var backend int
	if err := conn.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return 0, fmt.Errorf("proccpu: %w", err)
	}
	st, err := stat(backend)
	if err != nil {
		return 0, fmt.Errorf("proccpu: the server's processes are not on this machine (/proc/%d: %w)", backend, err)
	}
	return st.ppid, nil
}

// ClockTick is USER_HZ, the unit of /proc/<pid>/stat's times, so the resolution of Server: 100
// on Linux's common platforms.
const ClockTick = 10 * time.Millisecond

// Server is the CPU time of the server whose postmaster is pid: the postmaster's own and its
// reaped children's, and every live child's (backends, background processes). A backend that
// exits between two calls moves from the second term to the first, so differences count it once.
func Server(postmaster int) (time.Duration, error) {
	if postmaster <= 0 {
		return 0, errors.New("proccpu: no postmaster")
	}
	pm, err := stat(postmaster)
	if err != nil {
		return 0, fmt.Errorf("proccpu: %w", err)
	}
	ticks := pm.utime + pm.stime + pm.cutime + pm.cstime
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, fmt.Errorf("proccpu: %w", err)
	}
	for _, en := range entries {
		pid, err := strconv.Atoi(en.Name())
		if err != nil || pid == postmaster {
			continue
		}
		st, err := stat(pid)
		if err != nil || st.ppid != postmaster {
			continue // gone meanwhile, or not the server's
		}
		ticks += st.utime + st.stime
	}
	return time.Duration(ticks) * ClockTick, nil
}

// Process is the user + system CPU time of process pid so far (of its threads, not of its
// reaped children): with a backend's pid from pg_stat_activity, the server's time for one
// connection.
func Process(pid int) (time.Duration, error) {
	st, err := stat(pid)
	if err != nil {
		return 0, fmt.Errorf("proccpu: %w", err)
	}
	return time.Duration(st.utime+st.stime) * ClockTick, nil
}

type procStatus struct {
	ppid                         int
	utime, stime, cutime, cstime int64 // clock ticks
}

func stat(pid int) (procStatus, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStatus{}, err
	}
	s := string(b)
	// The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return procStatus{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3 (state)
	if len(f) < 15 {
		return procStatus{}, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	var st procStatus
	st.ppid, _ = strconv.Atoi(f[1])
	st.utime, _ = strconv.ParseInt(f[11], 10, 64)
	st.stime, _ = strconv.ParseInt(f[12], 10, 64)
	st.cutime, _ = strconv.ParseInt(f[13], 10, 64)
	st.cstime, _ = strconv.ParseInt(f[14], 10, 64)
	return st, nil
}
