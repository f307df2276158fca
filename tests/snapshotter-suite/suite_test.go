// Runs containerd's snapshotter conformance suite against `lamina
// snapshotter` over gRPC, through containerd's own proxy client: the same
// path containerd takes to a proxy plugin.
//
// One snapshotter process per test root. The binary comes from $LAMINA_BIN;
// scripts/snapshotter-suite.sh builds and runs this (as root: the suite
// mounts what the snapshotter returns).
package suite

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func TestLaminaSnapshotter(t *testing.T) {
	bin := os.Getenv("LAMINA_BIN")
	if bin == "" {
		t.Fatal("LAMINA_BIN must name the lamina binary")
	}
	// The suite picks expectations by name: "overlayfs" (like "erofs",
	// whose snapshotter also stacks overlayfs) skips renaming a directory
	// of a lower layer, which overlayfs refuses with EXDEV unless
	// redirect_dir is on. lamina's snapshots are overlayfs layers and keep
	// redirect_dir off, as containerd's own do, so diffs stay plain.
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		return startSnapshotter(ctx, bin, root)
	})
}

// startSnapshotter starts `lamina snapshotter` on root, waits for its socket
// and returns a proxy client plus a cleanup that stops the process.
func startSnapshotter(ctx context.Context, bin, root string) (snapshots.Snapshotter, func() error, error) {
	sock := filepath.Join(root, "lamina.sock")
	cmd := exec.Command(bin, "snapshotter", "--root", root, "--address", sock)
	log, err := os.Create(root + ".log")
	if err != nil {
		return nil, nil, err
	}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	stop := func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			return fmt.Errorf("lamina snapshotter did not stop within 10 s")
		}
	}
	conn, err := dial(ctx, sock)
	if err != nil {
		_ = stop()
		out, _ := os.ReadFile(root + ".log")
		return nil, nil, fmt.Errorf("%w; snapshotter log:\n%s", err, out)
	}
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "lamina")
	cleanup := func() error {
		conn.Close()
		return stop()
	}
	return sn, cleanup, nil
}

// dial waits up to 20 s for the socket to accept a connection.
func dial(ctx context.Context, sock string) (*grpc.ClientConn, error) {
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("socket %s not ready after 20 s: %w", sock, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
}
