// The lab's GPU device plugin: advertises `nvidia.com/gpu` on the lab's real kubelet node through
// the kubelet's device-plugin API (v1beta1), as NVIDIA's k8s-device-plugin does on a real GPU node.
//
// The devices are not real: there is no GPU on this machine. The kubelet counts, allocates and
// frees them like real ones (a pod asking for more than are free stays Pending; two pods never
// get the same device), and Allocate tells the container which ones it got in the same variable
// NVIDIA's plugin sets (NVIDIA_VISIBLE_DEVICES). The trainer still runs on the CPU; what the lab
// GPU's memory allows is decided by the trainer itself from variables the lab injects
// (images/trainer/finetune_trainer/faults.py, e2e/lab/gpuwebhook.py).
//
// Usage: lab-gpu-plugin -dir <kubelet root>/device-plugins -count 2
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const resourceName = "nvidia.com/gpu"

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the device list once and then holds the stream open: the devices never
// change health, and the kubelet treats a closed stream as the plugin gone.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		for _, id := range c.DevicesIds {
			if !p.known(id) {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		ids := strings.Join(c.DevicesIds, ",")
		log.Printf("allocate %s", ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": ids},
		})
	}
	return resp, nil
}

func (p *plugin) known(id string) bool {
	for _, d := range p.devices {
		if d.ID == id {
			return true
		}
	}
	return false
}

func register(dir, endpoint string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     endpoint,
		ResourceName: resourceName,
	})
	return err
}

// serve listens on our socket and registers with the kubelet; it returns when the kubelet's socket
// is recreated (a kubelet restart forgets every plugin) so that main registers again.
func serve(dir string, count int, stop <-chan os.Signal) (bool, error) {
	endpoint := "lab-gpu.sock"
	path := filepath.Join(dir, endpoint)
	_ = os.Remove(path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		return false, err
	}
	p := &plugin{}
	for i := 0; i < count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("lab-gpu-%d", i), Health: pluginapi.Healthy})
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	kubelet := filepath.Join(dir, "kubelet.sock")
	var registered os.FileInfo
	for {
		info, statErr := os.Stat(kubelet)
		switch {
		case statErr != nil:
			registered = nil
		case registered == nil || !os.SameFile(info, registered):
			if err := register(dir, endpoint); err != nil {
				log.Printf("register with the kubelet: %v (retrying)", err)
			} else {
				log.Printf("registered %d x %s with the kubelet", count, resourceName)
				registered = info
			}
		}
		select {
		case <-stop:
			return true, nil
		case <-time.After(time.Second):
		}
		if _, err := os.Stat(path); err != nil {
			// The kubelet removes every socket in its directory when it starts again.
			return false, nil
		}
	}
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	count := flag.Int("count", 1, "how many devices to advertise")
	flag.Parse()
	if *count < 1 {
		log.Fatalf("-count must be at least 1, got %d", *count)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	for {
		done, err := serve(*dir, *count, stop)
		if err != nil {
			log.Fatal(err)
		}
		if done {
			return
		}
	}
}
