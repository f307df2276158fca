// cri-run: a small CRI client (the CRI gRPC API from k8s.io/cri-api) that
// runs one container in one pod the way the kubelet would: pull the pod
// sandbox image and the container image, run a host-network pod sandbox,
// create and start the container, wait for it to exit, print its log and
// exit code as JSON, then stop and remove the pod.
//
// Usage: cri-run -endpoint SOCK [-image-endpoint SOCK] [-creds USER:PASSWORD]
//
//	-sandbox-image REF -image REF [-timeout 300s] -- CMD...
//
// -image-endpoint is where images are pulled (the kubelet's
// --image-service-endpoint; default: -endpoint), and -creds the pod's pull
// secret, sent with both pulls.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
)

type result struct {
	PodID       string `json:"pod_id"`
	ContainerID string `json:"container_id"`
	ExitCode    int32  `json:"exit_code"`
	Log         string `json:"log"`
	ImageRef    string `json:"image_ref"`
}

func main() {
	endpoint := flag.String("endpoint", "", "containerd's socket")
	imageEndpoint := flag.String("image-endpoint", "", "the image service's socket (default: -endpoint)")
	creds := flag.String("creds", "", "USER:PASSWORD sent with the pulls")
	sandboxImage := flag.String("sandbox-image", "", "pod sandbox (pause) image")
	image := flag.String("image", "", "container image")
	timeout := flag.Duration("timeout", 300*time.Second, "bound on the whole run")
	logDir := flag.String("log-dir", os.TempDir(), "where the container's log goes")
	flag.Parse()
	if *endpoint == "" || *image == "" || *sandboxImage == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: cri-run -endpoint SOCK -sandbox-image REF -image REF -- CMD...")
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if *imageEndpoint == "" {
		*imageEndpoint = *endpoint
	}
	var auth *cri.AuthConfig
	if *creds != "" {
		user, pass, ok := strings.Cut(*creds, ":")
		if !ok {
			fmt.Fprintln(os.Stderr, "cri-run: -creds must be USER:PASSWORD")
			os.Exit(2)
		}
		auth = &cri.AuthConfig{Username: user, Password: pass}
	}
	res, err := run(ctx, endpoints{*endpoint, *imageEndpoint}, *sandboxImage, *image, *logDir, auth, flag.Args())
	if err != nil {
		fmt.Fprintln(os.Stderr, "cri-run:", err)
		os.Exit(1)
	}
	_ = json.NewEncoder(os.Stdout).Encode(res)
}

type endpoints struct{ runtime, image string }

func dial(endpoint string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

func run(ctx context.Context, ep endpoints, sandboxImage, image, logDir string, auth *cri.AuthConfig, cmd []string) (*result, error) {
	conn, err := dial(ep.runtime)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	imageConn, err := dial(ep.image)
	if err != nil {
		return nil, err
	}
	defer imageConn.Close()
	rt, img := cri.NewRuntimeServiceClient(conn), cri.NewImageServiceClient(imageConn)

	podLogs, err := os.MkdirTemp(logDir, "pod-")
	if err != nil {
		return nil, err
	}
	sandbox := &cri.PodSandboxConfig{
		Metadata:     &cri.PodSandboxMetadata{Name: "lamina-test", Uid: fmt.Sprint(time.Now().UnixNano()), Namespace: "default"},
		LogDirectory: podLogs,
		Linux: &cri.LinuxPodSandboxConfig{SecurityContext: &cri.LinuxSandboxSecurityContext{
			// Host network: no CNI needed on the test machine.
			NamespaceOptions: &cri.NamespaceOption{Network: cri.NamespaceMode_NODE},
		}},
	}
	for _, ref := range []string{sandboxImage, image} {
		if _, err := img.PullImage(ctx, &cri.PullImageRequest{Image: &cri.ImageSpec{Image: ref}, Auth: auth, SandboxConfig: sandbox}); err != nil {
			return nil, fmt.Errorf("pulling %s: %w", ref, err)
		}
	}
	pod, err := rt.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: sandbox})
	if err != nil {
		return nil, fmt.Errorf("running the pod sandbox: %w", err)
	}
	defer func() {
		// A fresh context: the pod goes even when the run timed out.
		c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		_, _ = rt.StopPodSandbox(c, &cri.StopPodSandboxRequest{PodSandboxId: pod.PodSandboxId})
		_, _ = rt.RemovePodSandbox(c, &cri.RemovePodSandboxRequest{PodSandboxId: pod.PodSandboxId})
	}()
	created, err := rt.CreateContainer(ctx, &cri.CreateContainerRequest{
		PodSandboxId: pod.PodSandboxId,
		Config: &cri.ContainerConfig{
			Metadata: &cri.ContainerMetadata{Name: "main"},
			Image:    &cri.ImageSpec{Image: image},
			Command:  cmd,
			LogPath:  "main.log",
		},
		SandboxConfig: sandbox,
	})
	if err != nil {
		return nil, fmt.Errorf("creating the container: %w", err)
	}
	if _, err := rt.StartContainer(ctx, &cri.StartContainerRequest{ContainerId: created.ContainerId}); err != nil {
		return nil, fmt.Errorf("starting the container: %w", err)
	}
	status, err := waitExited(ctx, rt, created.ContainerId)
	if err != nil {
		return nil, err
	}
	log, _ := os.ReadFile(filepath.Join(podLogs, "main.log"))
	return &result{
		PodID:       pod.PodSandboxId,
		ContainerID: created.ContainerId,
		ExitCode:    status.ExitCode,
		Log:         string(log),
		ImageRef:    status.ImageRef,
	}, nil
}

func waitExited(ctx context.Context, rt cri.RuntimeServiceClient, id string) (*cri.ContainerStatus, error) {
	for {
		st, err := rt.ContainerStatus(ctx, &cri.ContainerStatusRequest{ContainerId: id})
		if err != nil {
			return nil, fmt.Errorf("container status: %w", err)
		}
		if st.Status.State == cri.ContainerState_CONTAINER_EXITED {
			return st.Status, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("container %s did not exit: %w", id, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
