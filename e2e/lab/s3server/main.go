// The lab's S3-compatible server: rclone's `serve s3` over its local backend, and nothing else.
//
// rclone's own main imports every backend and command (hundreds of modules); this one imports
// only the local backend, the serve and version commands and the S3 server, so a cold build
// takes minutes, not tens of minutes. The version is pinned by RCLONE_VERSION in
// ../versions.env and the require line of go.mod (a fast test checks they agree).
package main

import (
	_ "github.com/rclone/rclone/backend/local"
	"github.com/rclone/rclone/cmd"
	_ "github.com/rclone/rclone/cmd/serve"
	_ "github.com/rclone/rclone/cmd/serve/s3"
	_ "github.com/rclone/rclone/cmd/version"
)

func main() {
	cmd.Main()
}
