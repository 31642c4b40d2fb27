// Command etcd is the stock etcd server, built from the official etcd Go
// module so that tests and the simulation get a real etcd without a prebuilt
// download. It only calls etcdmain.Main; the version is pinned in go.mod.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
