// Command kfakeserver runs franz-go's kfake, an in-process Kafka cluster that speaks the Kafka
// wire protocol, as a process of its own: brokertest starts it for the end-to-end tests and the
// example, and kills it with SIGKILL or stops it with SIGTERM like the other brokers. It keeps its
// log and group state in -dir and writes every batch to disk before acknowledging it (SyncWrites),
// so that a restart on the same port and directory finds what it acknowledged.
//
// It is its own module because kfake requires a newer Go than the library's floor; it is built
// outside the workspace (GOWORK=off).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	port := flag.Int("port", 9092, "the port to listen on (127.0.0.1)")
	dir := flag.String("dir", "", "the data directory (required)")
	partitions := flag.Int("partitions", 8, "the number of partitions of an automatically created topic")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "kfakeserver: -dir is required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	c, err := kfake.NewCluster(
		kfake.NumBrokers(1), kfake.Ports(*port),
		kfake.DataDir(filepath.Join(*dir, "data")), kfake.SyncWrites(),
		kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(*partitions),
	)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kfakeserver: %v\n", err)
		os.Exit(1)
	}
	// The state is loaded and the listener open: tell the starter.
	if err := os.WriteFile(filepath.Join(*dir, "ready"), []byte(fmt.Sprint(os.Getpid())), 0o644); err != nil {
		fmt.Fprintf(os.Stderr, "kfakeserver: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("kfakeserver: listening on %v, data in %s\n", c.ListenAddrs(), *dir)
	<-ctx.Done()
	c.Close()
}
